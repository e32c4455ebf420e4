"""The paper's scaling figure: tau and speedup of a drafter against its finetuning tokens.

Evaluates the drafter at step 0 (before finetuning) and at every saved finetuning
checkpoint of a recipe, on the first `limit` benchmark questions, and plots both on a log axis.

    python -m jaxspec.bench.scaling --config configs/deen_gemma3_cpu.yaml \
        --questions ../shared/data/specbench/deen_question.jsonl --limit 20 --out runs/scaling
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def _checkpoints(cfg: dict, stage: str) -> Path:
    return Path(cfg["train"]["workdir"]).absolute() / stage / "checkpoints"


def _restore_params(ckpts: Path, step: int | None = None):
    """Params of a trainer checkpoint dir at `step` (None: the latest)."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(ckpts) as mngr:
        step = mngr.latest_step() if step is None else step
        state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return state["state"]["params"]


def drafter_at(cfg: dict, target, step: int):
    """(config, params, head vocab ids or None) of the recipe's drafter after `step` finetuning
    steps (0: before finetuning, i.e. pretrained when the recipe pretrains, else as initialised)."""
    from jaxspec.training import distill, recipe

    records = distill.read_distilled(cfg["distill"]["out_dir"])
    config, params, vocab_ids = recipe.init_drafter(
        cfg, target, [r["prompt_ids"] + r["response_ids"] for r in records])
    if step > 0:
        params = _restore_params(_checkpoints(cfg, "finetune"), step)
    elif _checkpoints(cfg, "pretrain").exists():
        params = _restore_params(_checkpoints(cfg, "pretrain"))
    return config, params, vocab_ids


def finetune_steps(cfg: dict) -> list[int]:
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(_checkpoints(cfg, "finetune")) as mngr:
        return sorted(mngr.all_steps())


def response_tokens(cfg: dict, pad_id: int, steps: list[int]) -> dict[int, int]:
    """Distilled response tokens (the loss-bearing ones) seen by each finetuning step, replaying
    the trainer's batches."""
    from jaxspec.training import distill, recipe

    batches = recipe.finetune_batches(distill.read_distilled(cfg["distill"]["out_dir"]),
                                      recipe.stage_settings(cfg, "finetune"), pad_id)
    seen, out = 0, {0: 0}
    for step in range(1, max(steps, default=0) + 1):
        seen += int(batches.next()["mask"][:, 1:].sum())  # row token 0 is never a target
        out[step] = seen
    return out


def measure(cfg: dict, questions: str, limit: int, gamma: int, max_new_tokens: int,
            steps: list[int] | None = None) -> list[dict]:
    import jaxspec
    from jaxspec.questions import read_questions
    from jaxspec.models.model import Model
    from jaxspec.training import recipe

    target = recipe.load_target(cfg["target"], cfg.get("dtype", "float32"))
    template = cfg.get("template", "{prompt}")
    stop = cfg["distill"].get("stop")
    prompts = [template.format(prompt=q["turns"][0]) for q in read_questions(questions)[:limit]]
    base = [jaxspec.generate(target, [p], max_new_tokens=max_new_tokens, stop=stop)
            for p in prompts]
    base_speed = np.mean([r.tokens_per_s for r in base])
    steps = [0, *(steps or finetune_steps(cfg))]
    tokens = response_tokens(cfg, target.config.pad_token_id, steps)
    rows = []
    for step in steps:
        config, params, vocab_ids = drafter_at(cfg, target, step)
        drafter = jaxspec.model_drafter(Model(config, params, name=f"step{step}"), vocab_ids)
        outs = [jaxspec.speculative_generate(target, drafter, [p], gamma=gamma,
                                             max_new_tokens=max_new_tokens, stop=stop)
                for p in prompts]
        rows.append({
            "step": step, "finetune_tokens": tokens[step],
            "tau": float(np.mean([a for r in outs for a in r.accept_lengths[0]])),
            "speedup": float(np.mean([r.tokens_per_s for r in outs]) / base_speed),
            "identical": all(r.token_ids == b.token_ids for r, b in zip(outs, base))})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    before = [r for r in rows if r["finetune_tokens"] == 0]
    rows = [r for r in rows if r["finetune_tokens"] > 0]
    fig = Figure(figsize=(8, 3.5))
    FigureCanvasAgg(fig)
    x = [r["finetune_tokens"] for r in rows]
    for i, key in enumerate(("speedup", "tau")):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.plot(x, [r[key] for r in rows], marker="o", label="finetuned")
        if before:  # step 0 has no place on a log axis: a reference line
            ax.axhline(before[0][key], color="gray", linestyle="--", label="before finetuning")
            ax.legend(fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("finetuning tokens (distilled responses)")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Specialised drafter vs finetuning tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    from jaxspec.config import load_yaml

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the recipe YAML that trained the drafter")
    p.add_argument("--questions", required=True)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, nargs="*", help="checkpoints to use (default: all)")
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--export", nargs=2, metavar=("STEP", "DIR"),
                   help="only save the drafter at STEP (0: before finetuning) to DIR")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    a = p.parse_args(argv)
    cfg = load_yaml(a.config, a.overrides)
    if a.export:
        from jaxspec.training.drafter_init import save_drafter
        from jaxspec.training.recipe import embed_source, load_target

        target = load_target(cfg["target"], cfg.get("dtype", "float32"))
        config, params, vocab_ids = drafter_at(cfg, target, int(a.export[0]))
        save_drafter(a.export[1], config, params, target.tokenizer, vocab_ids,
                     embed_from=embed_source(cfg))
        print(f"wrote {a.export[1]}")
        return
    rows = measure(cfg, a.questions, a.limit, a.gamma, a.max_new_tokens, a.steps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out / "scaling.png")
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")


if __name__ == "__main__":
    main()
