"""The package's layers, bottom to top: a module imports only from its own layer or below, and no
imports run in a cycle (lazy imports inside functions count too). A new module must be placed in
a layer here."""

import ast
import pathlib

import pytest

import jaxspec

ROOT = pathlib.Path(jaxspec.__file__).parent
LAYERS = [
    ("base", ("jaxspec.errors", "jaxspec.files", "jaxspec.config", "jaxspec.archs",
              "jaxspec.cpu_flags", "jaxspec.questions", "jaxspec.images")),
    ("models", ("jaxspec.models", "jaxspec.sharding")),
    ("checkpoints", ("jaxspec.checkpoints",)),
    ("loop", ("jaxspec.decoding.sampling", "jaxspec.decoding.trees", "jaxspec.decoding.plan",
              "jaxspec.decoding.speculative", "jaxspec.decoding.stops",
              "jaxspec.decoding.xla_cache", "jaxspec.decoding.executables",
              "jaxspec.drafters.base")),
    ("drafters", ("jaxspec.drafters",)),
    ("loading", ("jaxspec.loading",)),
    ("runner", ("jaxspec.decoding.runner", "jaxspec.decoding.memory",
                "jaxspec.decoding.image_prompts")),
    ("step costs", ("jaxspec.decoding.profile",)),
    ("api", ("jaxspec.decoding.api",)),
    ("tuning and routing", ("jaxspec.decoding.skip_search", "jaxspec.decoding.tree_search",
                            "jaxspec.decoding.routing")),
    ("public package", ("jaxspec", "jaxspec.decoding")),
    ("training", ("jaxspec.training",)),
    ("bench", ("jaxspec.bench",)),
    ("entry points", ("jaxspec.cli", "jaxspec.demo", "jaxspec.bench.__main__")),
]


def sources(root=ROOT) -> dict[str, str]:
    """Module name -> source text of every module of the package."""
    out = {}
    for path in root.rglob("*.py"):
        parts = ("jaxspec",) + path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def imports(source: str, modules) -> set[str]:
    """The jaxspec modules `source` imports: `from a import b` names the module a.b when there is
    one, else a."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "jaxspec"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module.split(".")[0] == "jaxspec"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def layer_of(module: str) -> int:
    """The index of the layer whose longest listed prefix holds `module`."""
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and p.count(".") > depth:
                best, depth = i, p.count(".")
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(srcs: dict[str, str]) -> list[str]:
    graph = {m: imports(s, srcs) - {m} for m, s in srcs.items()}
    found = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if layer_of(d) > layer_of(m):
                found.append(f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} "
                             f"({LAYERS[layer_of(d)][0]})")
    found += [f"cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return found


def test_the_package_imports_only_downward_and_without_cycles():
    srcs = sources()
    assert len(srcs) > 60 and "jaxspec.decoding.api" in srcs
    assert violations(srcs) == []


def test_an_upward_import_and_a_cycle_are_caught():
    srcs = sources()
    upward = {**srcs, "jaxspec.decoding.xla_cache": srcs["jaxspec.decoding.xla_cache"]
              + "\n\ndef f():\n    from jaxspec.bench import table1\n"}
    assert violations(upward) == ["jaxspec.decoding.xla_cache (loop) imports "
                                  "jaxspec.bench.table1 (bench)"]
    loop = {**srcs, "jaxspec.decoding.trees": srcs["jaxspec.decoding.trees"]
            + "\nfrom jaxspec.decoding import stops\n"}
    assert violations(loop) == ["cycle: jaxspec.decoding.speculative -> jaxspec.decoding.stops "
                                "-> jaxspec.decoding.trees -> jaxspec.drafters.base"]


def test_every_module_has_a_layer():
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("elsewhere.module")
    for m in sources():
        layer_of(m)
