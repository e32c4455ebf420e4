"""Where a compiled computation's time goes, from `jax.profiler`'s op events: the time of each
XLA op (summed over threads), grouped by what it computes, and the share of matrix products.

An op counts as a matrix product when its HLO instruction, or the computation a fusion calls, holds
a `dot` or `convolution` (XLA:CPU runs most of them as library fusions, `ynn_fusion.N`).
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from typing import Callable, Iterable

import jax

_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMP = re.compile(r"^%([\w.\-]+) \(")
_MODULE = re.compile(r"^HloModule (\S+?),")
_PRODUCTS = ("dot", "convolution")


def _products(hlo_texts: Iterable[str]) -> dict[tuple[str, str], tuple[bool, str, str]]:
    """(module, instruction) -> (is a matrix product, the op name it came from, or that of the
    first named instruction of the computation it calls, its output shape) for every
    instruction of the modules."""
    out = {}
    for text in hlo_texts:
        module, comp, product_name, first_name, instrs = "", None, {}, {}, []
        for line in text.splitlines():
            if m := _MODULE.match(line):
                module = m.group(1)
            elif m := _COMP.match(line):
                comp = m.group(1)
            elif m := _INSTR.match(line):
                name, shape, opcode = m.groups()
                callee, op_name = _CALLS.search(line), _OP_NAME.search(line)
                op_name = op_name.group(1) if op_name else ""
                if opcode in _PRODUCTS:
                    product_name[comp] = product_name.get(comp) or op_name or "dot"
                if op_name:
                    first_name.setdefault(comp, op_name)
                instrs.append((name, shape, opcode, callee and callee.group(1), op_name))
        for name, shape, opcode, callee, op_name in instrs:
            product = product_name.get(callee)
            out[(module, name)] = (opcode in _PRODUCTS or bool(product),
                                   op_name or product or first_name.get(callee, ""), shape)
    return out


def trace(run: Callable[[], object], hlo_texts: Callable[[], Iterable[str]]) -> dict:
    """Run `run()` under the profiler; `hlo_texts()` (called after) gives the compiled modules'
    text. Returns total op milliseconds, the matrix products' share, and the milliseconds per
    group of ops, grouped two ways: by fusion kind and source op (`groups_ms`, e.g. "ynn_fusion
    dot_general") and by fusion kind and output shape (`shapes_ms`, e.g. "ynn_fusion
    f32[2048,3]{1,0}": products of different weights stand apart)."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        data = jax.profiler.ProfileData.from_file(
            glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    kinds = _products(hlo_texts())
    groups, shapes, total, products = collections.Counter(), collections.Counter(), 0.0, 0.0
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats:
                    continue
                ms = event.duration_ns / 1e6
                is_product, op_name, shape = kinds.get(
                    (stats.get("hlo_module", ""), stats["hlo_op"]), (False, "", ""))
                kind = re.sub(r"\.\d+$", "", stats["hlo_op"])
                groups[f"{kind} {op_name.rsplit('/', 1)[-1]}".strip()] += ms
                shapes[f"{kind} {shape}".strip()] += ms
                total += ms
                products += ms if is_product else 0.0
    return {"op_ms": total, "product_share": products / total if total else 0.0,
            "groups_ms": dict(groups.most_common()), "shapes_ms": dict(shapes.most_common())}


def format_trace(r: dict, top: int = 10) -> str:
    lines = [f"XLA ops {r['op_ms']:.0f} ms (summed over threads), matrix products "
             f"{100 * r['product_share']:.0f}%"]
    lines += [f"  {ms:9.1f} ms  {name}" for name, ms in list(r["groups_ms"].items())[:top]]
    return "\n".join(lines)
