"""The `jaxspec` command. Every subcommand takes `--config FILE.yaml` and trailing `key=value`
overrides; explicit flags win over both."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from jaxspec.config import load_yaml, merge
from jaxspec.errors import UserError


def _options(args, defaults: dict) -> dict:
    """defaults <- YAML <- key=value overrides <- flags given on the command line."""
    cfg = merge(defaults, load_yaml(args.config, args.overrides))
    flags = {k: v for k, v in vars(args).items()
             if v is not None and k not in ("config", "overrides", "command", "func")}
    return merge(cfg, flags)


def _gamma(text: str):
    """A draft length, or "auto" (each row picks its own every step)."""
    return text if text == "auto" else int(text)


def _tree(text: str):
    """Token tree paths: JSON "choices" ("[[0], [1], [0, 0]]"), or widths per depth ("3,2,1":
    every node at depth d has the d-th width of children); or an EAGLE-2 dynamic tree
    ("dynamic:BUDGET[:DEPTH[:WIDTH]]", a `trees.DynamicTree`)."""
    from jaxspec.decoding import trees

    if isinstance(text, str) and text.startswith("dynamic"):
        return trees.make_tree(text)
    if not isinstance(text, str):  # paths from a YAML config
        return trees.make_tree(text).paths
    if text.lstrip().startswith("["):
        return trees.make_tree(json.loads(text)).paths
    return trees.full_tree([int(w) for w in text.split(",")]).paths


def _add_common(p: argparse.ArgumentParser):
    p.add_argument("--config", help="YAML file of options (flags and key=value override it)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override any option, e.g. max_new_tokens=32 or train.lr=1e-4")


def _mesh(o: dict):
    """`distributed` (None, "auto" or a mapping) started, then the mesh of `mesh` ("data,fsdp,
    tensor" or a mapping of those sizes; one may be -1) over every device, or None."""
    from jaxspec import sharding

    sharding.init_distributed(o.get("distributed"))
    m = o.get("mesh")
    if not m:
        return None
    if isinstance(m, dict):
        return sharding.make_mesh(m.get("data", -1), m.get("fsdp", 1), m.get("tensor", 1))
    return sharding.make_mesh(*(int(x) for x in str(m).split(",")))


def cmd_generate(args):
    import jaxspec

    o = _options(args, {"model": "smollm2-135m-instruct", "max_new_tokens": 64,
                        "temperature": 0.0, "chat": False, "seed": 0, "dtype": "auto"})
    if not o.get("prompt"):
        raise SystemExit("jaxspec generate: give --prompt")
    images = o.get("image")
    if images and len(o["prompt"]) > 1 and len(images) != len(o["prompt"]):
        raise SystemExit("jaxspec generate: with several prompts give one --image per prompt")
    model = jaxspec.load(o["model"], dtype=o["dtype"], mesh=_mesh(o))
    kw = dict(max_new_tokens=o["max_new_tokens"], temperature=o["temperature"],
              top_k=o.get("top_k"), top_p=o.get("top_p"), seed=o["seed"], stop=o.get("stop"),
              chat=o["chat"])
    if images:
        kw["images"] = [images] if len(o["prompt"]) == 1 else images
    if o.get("drafter"):
        from jaxspec.loading import parse_drafter

        d = parse_drafter(o["drafter"], model)
        tree = _tree(o["tree"]) if o.get("tree") else None
        r = jaxspec.speculative_generate(model, d, o["prompt"],
                                         gamma=None if tree else o.get("gamma"), tree=tree,
                                         image_placeholder=o.get("image_placeholder"), **kw)
    else:
        r = jaxspec.generate(model, o["prompt"], **kw)
    for text in r.texts:
        print(text)
    print(f"[{r.num_new_tokens} tokens, {r.tokens_per_s:.1f} tok/s, tau {r.tau:.2f}, "
          f"compile {r.compile_time_s:.1f}s]", file=sys.stderr)


def cmd_bench(args):
    from jaxspec.bench import specbench
    from jaxspec.questions import read_references
    from jaxspec.bench.report import report

    o = _options(args, {"questions": None, "out_dir": "runs/bench", "max_new_tokens": 64,
                        "gammas": [4], "temperatures": [0.0], "limit": None, "seed": 0,
                        "dtype": "auto"})
    if not o.get("questions"):
        raise SystemExit("jaxspec bench: give --questions (a Spec-Bench question.jsonl)")
    runs = o.get("runs") or [{k: o[k] for k in ("target", "methods", "template", "chat", "stop")
                              if k in o}]
    mesh = _mesh(o)
    results = {}
    for run in runs:
        run = {**{k: v for k, v in o.items() if k != "runs"}, **run}
        if not run.get("target") or not run.get("methods"):
            raise SystemExit("jaxspec bench: each run needs a target and methods")
        if run["dtype"] == "auto":
            from jaxspec.loading import native_dtype, resolve

            run["dtype"] = native_dtype(resolve(run["target"]))
        if "ar" not in run["methods"]:
            run["methods"] = ["ar", *run["methods"]]
        methods = specbench.parse_methods(run["methods"], run["gammas"], run["temperatures"],
                                          _tree(run["tree"]) if run.get("tree") else None)
        out = Path(run["out_dir"]) / (run.get("name") or f"{Path(run['target']).name}-{run['dtype']}")
        files = specbench.run_bench(
            run["target"], run["questions"], methods, str(out),
            max_new_tokens=run["max_new_tokens"], template=run.get("template") or "{prompt}",
            chat=bool(run.get("chat")), stop=run.get("stop"), limit=run["limit"],
            seed=run["seed"], dtype=run["dtype"], mesh=mesh,
            image_placeholder=run.get("image_placeholder"))
        baseline = next(m.name for m in methods if m.kind == "ar" and m.temperature ==
                        run["temperatures"][0])
        refs = read_references(run["references"]) if run.get("references") else None
        key = run.get("name") or f"{run['target']} ({run['dtype']})"
        results[key] = report(files, baseline, out, refs)
        print((out / "report.md").read_text())
    Path(o["out_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(o["out_dir"]) / "results.json").write_text(json.dumps(results, indent=2))


def cmd_report(args):
    from jaxspec.bench.report import report

    o = _options(args, {"out_dir": None})
    files = {Path(f).stem: f for f in o.get("answers") or []}
    if not files or not o.get("baseline"):
        raise SystemExit("jaxspec report: give --answers FILE... and --baseline NAME")
    report(files, o["baseline"], o["out_dir"] or Path(next(iter(files.values()))).parent)
    print((Path(o["out_dir"] or Path(next(iter(files.values()))).parent) / "report.md")
          .read_text())


def cmd_table1(args):
    from jaxspec.bench import table1

    o = _options(args, {})
    table1.run(o.get("dirs") or [], o.get("out"))


def cmd_export(args):
    import jaxspec
    from jaxspec.checkpoints import store
    from jaxspec.checkpoints.hf import export_hf_dir

    o = _options(args, {"format": "hf"})
    if not o.get("model") or not o.get("out"):
        raise SystemExit("jaxspec export: give --model and --out")
    m = jaxspec.load(o["model"])
    if o["format"] == "hf":
        export_hf_dir(m.params, m.config, o["out"], m.tokenizer)
    elif o["format"] == "jaxspec":
        store.save(o["out"], m.params, m.config, m.tokenizer)
    else:
        raise SystemExit(f"jaxspec export: unknown format {o['format']!r} (hf, jaxspec)")
    print(f"wrote {o['out']}")


def cmd_demo(args):
    from jaxspec import demo

    o = _options(args, {"target": "gemma3-270m", "gamma": "auto", "max_new_tokens": 48,
                        "dtype": "bfloat16", "repeats": 3})
    rows = demo.run(o["target"], o.get("drafter"), o["gamma"], o["max_new_tokens"],
                    dtype=o["dtype"], repeats=int(o["repeats"]), quick=bool(o.get("quick")))
    if not all(r["identical"] for r in rows):
        raise SystemExit(1)


def cmd_profile(args):
    import jaxspec
    from jaxspec.decoding.profile import format_profile, profile, step_costs
    from jaxspec.loading import parse_drafter

    o = _options(args, {"model": "gemma3-270m", "dtype": "auto", "refresh": False})
    model = jaxspec.load(o["model"], dtype=o["dtype"])
    drafter = parse_drafter(o["drafter"], model) if o.get("drafter") else None
    r = profile(model, o["model"], drafter, o.get("drafter"), refresh=o["refresh"])
    if drafter is not None:
        r["step_costs"] = [round(c, 4) for c in step_costs(model, o["model"], drafter,
                                                           o["drafter"], 4)]
    print(json.dumps(r, indent=1) if o.get("json") else format_profile(r))


def cmd_plan(args):
    import jaxspec
    from jaxspec.checkpoints import heads
    from jaxspec.decoding.profile import plan_drafter
    from jaxspec.loading import parse_drafter

    o = _options(args, {"model": "gemma3-270m", "dtype": "auto", "gamma_max": 8,
                        "max_new_tokens": 64, "limit": 10, "template": "{prompt}"})
    if not o.get("drafter") or not (o.get("prompt") or o.get("questions")):
        raise SystemExit("jaxspec plan: give --drafter and --prompt or --questions")
    if o.get("into") and not heads.is_head(o["into"]):
        raise SystemExit(f"jaxspec plan: --into {o['into']} is not a hidden-state drafter "
                         f"checkpoint (no {heads.MARKER})")
    prompts = _prompts(o)
    model = jaxspec.load(o["model"], dtype=o["dtype"])
    p = plan_drafter(model, o["model"], parse_drafter(o["drafter"], model), o["drafter"],
                     prompts, o["gamma_max"], o["max_new_tokens"], chat=bool(o.get("chat")),
                     stop=o.get("stop"), images=_images(o))
    print(p.describe())
    if o.get("into"):
        src = o.get("questions") or "--prompt"
        heads.set_accept(o["into"], p.accept_G, f"jaxspec plan, gamma {o['gamma_max']}, "
                         f"{len(prompts)} prompts of {src}, {o['dtype']}", p.best_gamma)
        print(f"recorded the acceptance{' and the best gamma' * bool(p.best_gamma)} in "
              f"{o['into']}")


def cmd_tune_layer_skip(args):
    import jaxspec
    from jaxspec.decoding import skip_search

    o = _options(args, {"model": "gemma3-270m", "dtype": "auto", "gamma_max": 4,
                        "max_new_tokens": 64, "limit": 8, "template": "{prompt}", "max_skip": None,
                        "out": "configs/bench/layer_skip.yaml"})
    if not (o.get("prompt") or o.get("questions")):
        raise SystemExit("jaxspec tune-layer-skip: give --prompt or --questions")
    prompts = _prompts(o)
    kw = dict(chat=bool(o.get("chat")), stop=o.get("stop"))
    model = jaxspec.load(o["model"], dtype=o["dtype"])
    tokens_BxL, weight_BxL = skip_search.greedy_texts(model, prompts, o["max_new_tokens"], **kw)
    found = skip_search.search(skip_search.agreement_fn(model, tokens_BxL, weight_BxL),
                               model.config.num_layers,
                               *skip_search.measured_costs(model, o["model"]),
                               gamma_max=o["gamma_max"], max_skip=o["max_skip"])
    print(found.describe())
    best = found.best
    measured = skip_search.measure(model, best.skip, best.gamma, prompts, o["max_new_tokens"],
                                   **kw)
    print(f"measured: {measured[0]:.3f}x over plain decoding, tau {measured[1]:.3f}")
    run = {k: o[k] for k in ("questions", "template", "stop", "chat", "max_new_tokens", "limit",
                             "dtype") if o.get(k) is not None}
    out = Path(o["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(skip_search.bench_config(found, measured, {"target": o["model"], **run}))
    print(f"wrote {out}")


def cmd_tune_tree(args):
    import jaxspec
    from jaxspec.checkpoints import heads
    from jaxspec.decoding import profile, tree_search
    from jaxspec.loading import parse_drafter

    o = _options(args, {"model": "gemma3-270m", "dtype": "auto", "width": 4, "depth": 4,
                        "budget": 15, "max_new_tokens": 64, "limit": 8, "template": "{prompt}",
                        "out": "configs/bench/tree.yaml"})
    if not o.get("drafter") or not (o.get("prompt") or o.get("questions")):
        raise SystemExit("jaxspec tune-tree: give --drafter and --prompt or --questions")
    tree_search.positive(width=o["width"], depth=o["depth"])
    if o.get("into") and not heads.is_head(o["into"]):
        raise SystemExit(f"jaxspec tune-tree: --into {o['into']} is not a hidden-state drafter "
                         f"checkpoint (no {heads.MARKER})")
    prompts = _prompts(o)
    model = jaxspec.load(o["model"], dtype=o["dtype"])
    drafter = parse_drafter(o["drafter"], model)
    prof = profile.profile(model, o["model"], drafter, o["drafter"])
    tree_search.check_budget(o["budget"], prof["relative_cost"])
    acc = tree_search.acceptance(model, drafter, prompts, o["width"], o["depth"],
                                 o["max_new_tokens"], chat=bool(o.get("chat")), stop=o.get("stop"))
    print(acc.describe())
    choice = tree_search.best_tree(acc.p_AxW, prof["relative_cost"], prof["c"], o["budget"])
    print(choice.describe())
    run = {k: o[k] for k in ("questions", "template", "stop", "chat", "max_new_tokens", "limit",
                             "dtype") if o.get(k) is not None}
    out = Path(o["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(tree_search.bench_config(choice, acc, {"target": o["model"], **run},
                                            o["drafter"]))
    print(f"wrote {out}")
    if o.get("into"):
        heads.set_tuned(o["into"], choice.best.tree.paths,
                        f"jaxspec tune-tree ({datetime.date.today()}): {choice.describe()}")
        print(f"recorded the tree in {o['into']}")


def cmd_distill(args):
    from jaxspec.training import recipe

    recipe.run_distill(_options(args, {}))


def cmd_train(args):
    from jaxspec.training import recipe

    recipe.run_train(_options(args, {}))


def _add_prompts(p: argparse.ArgumentParser, limit: int, gamma_max: int | None = None):
    """The target and the prompts a measurement decodes (and its largest gamma, if any)."""
    p.add_argument("--model", help="target (default gemma3-270m)")
    p.add_argument("--prompt", action="append", help="a prompt to measure on")
    p.add_argument("--questions", help="or a Spec-Bench question.jsonl")
    p.add_argument("--limit", type=int, help=f"prompts used (default {limit})")
    p.add_argument("--template", help="prompt template with {prompt}")
    if gamma_max is not None:
        p.add_argument("--gamma-max", dest="gamma_max", type=int,
                       help=f"largest gamma (default {gamma_max})")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    p.add_argument("--stop", help="stop string or token id")
    p.add_argument("--chat", action="store_true", default=None, help="apply the chat template")


def _prompts(o: dict) -> list[str]:
    """The prompts of --prompt or --questions, templated, at most --limit."""
    from jaxspec.questions import read_questions

    prompts = o.get("prompt") or [q["turns"][0] for q in read_questions(o["questions"])]
    return [o["template"].format(prompt=p) for p in prompts[:o["limit"]]]


def _images(o: dict) -> list[list[str]] | None:
    """The images of each of --questions' first --limit questions (paths relative to the
    file), or of --image for --prompt; None when there are none."""
    from jaxspec.questions import image_paths, read_questions

    if o.get("prompt"):
        return [o["image"]] * len(o["prompt"][:o["limit"]]) if o.get("image") else None
    rows = [image_paths(o["questions"], q) for q in read_questions(o["questions"])[:o["limit"]]]
    return rows if any(rows) else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, optionally with speculative decoding")
    g.add_argument("--model", help="registered name, .gguf, HF dir or jaxspec checkpoint")
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--drafter", help="ngram[:N], layerskip:LAYERS, or a drafter path")
    g.add_argument("--gamma", type=_gamma, help="draft length, or auto (default: the drafter's "
                   "tuned shape, else 4)")
    g.add_argument("--tree", help="draft a token tree instead: JSON paths [[0],[1],[0,0]] or "
                                  "widths per depth 3,2,1")
    g.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    g.add_argument("--temperature", type=float, help="0 is greedy (default)")
    g.add_argument("--top-k", dest="top_k", type=int)
    g.add_argument("--top-p", dest="top_p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="a stop string or token id (repeat for several)")
    g.add_argument("--chat", action="store_true", default=None, help="apply the chat template")
    g.add_argument("--image", action="append", help="an image file for a vision-language "
                   "target (Gemma 3 4B and larger): repeat for several in one prompt, or give "
                   "one per --prompt")
    g.add_argument("--image-placeholder", dest="image_placeholder",
                   help="text the drafter sees in place of each image (default: none)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="Spec-Bench run: baseline and methods, then a report")
    b.add_argument("--questions", help="Spec-Bench question.jsonl")
    b.add_argument("--target", help="target model")
    b.add_argument("--methods", nargs="+", help="ar ngram[:N] layerskip:L drafter:PATH hf "
                                                "hf-assisted:PATH")
    b.add_argument("--gammas", nargs="+", type=_gamma, help="draft lengths or auto (default 4)")
    b.add_argument("--tree", help="also run each speculative method with this token tree (JSON "
                                  "paths or widths per depth 3,2,1)")
    b.add_argument("--temperatures", nargs="+", type=float, help="default 0 (greedy)")
    b.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    b.add_argument("--template", help="prompt template with {prompt}")
    b.add_argument("--stop", help="stop string or token id")
    b.add_argument("--chat", action="store_true", default=None, help="apply the chat template")
    b.add_argument("--limit", type=int, help="only the first N questions")
    b.add_argument("--out-dir", dest="out_dir", help="where answers and reports go")
    b.add_argument("--references", help="JSONL of {question_id, reference}: adds chrF/BLEU")
    b.add_argument("--image-placeholder", dest="image_placeholder",
                   help="text drafters read in place of the questions' images (default: none)")
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", help="speedup and tau from model_answer files")
    r.add_argument("--answers", nargs="+", help="model_answer JSONL files (name = file stem)")
    r.add_argument("--baseline", help="the baseline's name (file stem)")
    r.add_argument("--out-dir", dest="out_dir")
    r.set_defaults(func=cmd_report)

    e = sub.add_parser("export", help="write a model as an HF directory or jaxspec checkpoint")
    e.add_argument("--model")
    e.add_argument("--out")
    e.add_argument("--format", choices=("hf", "jaxspec"))
    e.set_defaults(func=cmd_export)

    d = sub.add_parser("demo", help="translate 5 languages to English with speculative decoding")
    d.add_argument("--target")
    d.add_argument("--drafter", help="one drafter for every language (ngram[:N], layerskip:LAYERS, "
                                     "a name or path); default: the shipped drafter of each "
                                     "detected language, n-gram lookup for the others")
    d.add_argument("--gamma", type=_gamma, help="draft length, or auto")
    d.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    d.add_argument("--repeats", type=int, help="decodings of each sentence each way; tokens/s "
                                               "from the fastest (default 3)")
    d.add_argument("--quick", action="store_true", help="each sentence once each way, then "
                   "the other embedded model: a fresh install's check")
    d.set_defaults(func=cmd_demo)

    f = sub.add_parser("profile", help="cost of verifying S positions, drafter cost, roofline")
    f.add_argument("--model", help="target (default gemma3-270m)")
    f.add_argument("--drafter", help="ngram[:N], layerskip:LAYERS, or a drafter name or path")
    f.add_argument("--json", action="store_true", default=None, help="print JSON")
    f.add_argument("--refresh", action="store_true", default=None,
                   help="measure again instead of reading the cached profile")
    f.set_defaults(func=cmd_profile)

    n = sub.add_parser("plan", help="expected speedup of each gamma for a drafter (cost model)")
    _add_prompts(n, limit=10, gamma_max=8)
    n.add_argument("--drafter", help="ngram[:N], layerskip:LAYERS, or a drafter name or path")
    n.add_argument("--into", help="record the measured per-position acceptance (gamma auto "
                                  "starts from it) and the best gamma (its default draft "
                                  "length) in this hidden-state drafter")
    n.add_argument("--image", action="append", help="an image for each --prompt (a "
                   "vision-language target; questions give theirs in 'images')")
    n.set_defaults(func=cmd_plan)

    t = sub.add_parser("tune-layer-skip", help="search the layers a self-speculative drafter "
                                               "skips; write a bench config")
    _add_prompts(t, limit=8, gamma_max=4)
    t.add_argument("--max-skip", dest="max_skip", type=int,
                   help="most layers skipped (default: all but one)")
    t.add_argument("--out", help="bench config written (default configs/bench/layer_skip.yaml)")
    t.set_defaults(func=cmd_tune_layer_skip)

    u = sub.add_parser("tune-tree", help="choose a token tree from measured acceptance and "
                                         "cost; write a bench config")
    _add_prompts(u, limit=8)
    u.add_argument("--drafter", help="ngram[:N], layerskip:LAYERS, or a drafter name or path")
    u.add_argument("--width", type=int, help="candidates measured per node (default 4)")
    u.add_argument("--depth", type=int, help="depths measured (default 4); the full tree of "
                                             "width^1 + ... + width^depth nodes is drafted")
    u.add_argument("--budget", type=int, help="most tree nodes (default 15: the profile "
                                              "measures verifying up to 16 positions)")
    u.add_argument("--out", help="bench config written (default configs/bench/tree.yaml)")
    u.add_argument("--into", help="also record the tree in this hidden-state drafter's "
                                  "checkpoint directory: decoding with it then drafts that tree")
    u.set_defaults(func=cmd_tune_tree)

    t1 = sub.add_parser("table1", help="the paper's Table 1 (markdown) from bench reports of "
                                       "several language pairs")
    t1.add_argument("dirs", nargs="+", metavar="DIR", help="report directories or bench out_dirs")
    t1.add_argument("--out", help="also write the markdown to this file")
    t1.set_defaults(func=cmd_table1)

    for s in (g, b):
        s.add_argument("--mesh", help="data,fsdp,tensor device mesh, e.g. 1,1,8 (one size may "
                                      "be -1); params, caches and rows are split over it")
    for s in (g, b, d, f, n, t, u):
        s.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                       help="weight precision (activations stay float32); auto (the default): "
                            "the precision the model was trained in")

    for name, func, text in (
            ("distill", cmd_distill, "self-distillation: the target answers training prompts"),
            ("train", cmd_train, "pretrain or finetune a drafter")):
        s = sub.add_parser(name, help=text, description=text + ". Options: see configs/*.yaml.")
        s.set_defaults(func=func)
    for s in sub.choices.values():
        _add_common(s)
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except (UserError, FileNotFoundError, ModuleNotFoundError) as e:
        if os.environ.get("JAXSPEC_DEBUG"):
            raise
        raise SystemExit(f"jaxspec {args.command}: {e}") from None


if __name__ == "__main__":
    main()
