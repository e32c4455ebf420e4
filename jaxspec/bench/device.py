"""The accelerator benchmark (`launch/gpu_bench.sh`): what a step costs on whatever device JAX
sees, for Gemma 3 270M's shape in float32, bfloat16 and int8, and what the decode loop gets
from it: plain tokens/s by batch size and the loop's step cost drafting with an EAGLE head of
the shipped heads' shape. The weights are random (a borrowed machine reaches no model hub, and
the GGUF is larger than what travels to it): costs do not depend on the values, acceptance
does, so speedups are measured on CPU and only costs here. `--dry-run` runs a tiny model in
seconds, anywhere.

    python -m jaxspec.bench.device --out DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from jaxspec.models.presets import SHAPES

GEMMA3_270M = SHAPES["gemma3-270m"]
TINY = {**GEMMA3_270M, "vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
        "head_dim": 32, "intermediate_size": 128, "layer_types": ["sliding", "full"]}


def _model(config, dtype: str):
    import jax.numpy as jnp

    from jaxspec.models.model import Model
    from jaxspec.models.params import init_params
    from jaxspec.models.quant import quantize_params

    params = init_params(config, jax.random.key(0))
    if dtype == "int8":
        return Model(config, quantize_params(params), None, f"random-{dtype}")
    return Model(config, jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params), None,
                 f"random-{dtype}")


def _tokens_per_s(model, batch: int, new: int) -> float:
    """Plain greedy decoding of `batch` rows, `new` tokens each, after a compiling call."""
    from jaxspec.decoding.api import generate

    prompts = [[2 + (b + i) % 97 for i in range(32)] for b in range(batch)]
    generate(model, prompts, max_new_tokens=new)
    r = generate(model, prompts, max_new_tokens=new)
    return sum(len(t) for t in r.token_ids) / r.wall_time_s


def run(dry_run: bool) -> dict:
    from jaxspec.config import ModelConfig
    from jaxspec.decoding import profile
    from jaxspec.drafters.hidden import head_params, hidden_drafter

    config = ModelConfig.from_dict(TINY if dry_run else GEMMA3_270M)
    sizes, batches, new = ((1, 4), (1, 2), 8) if dry_run else ((1, 2, 4, 8, 16), (1, 8, 32), 64)
    out = {"device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}",
           "backend": jax.default_backend(), "jax": jax.__version__, "dry_run": dry_run,
           "model": "tiny" if dry_run else "gemma3-270m shape, random weights", "dtypes": {}}
    t0 = time.perf_counter()
    for dtype in ("float32", "bfloat16", "int8"):
        model = _model(config, dtype)
        ms = profile.target_ms(model, sizes=sizes, repeats=3 if dry_run else 20)
        r = {"target_ms": {str(s): round(t, 3) for s, t in ms.items()},
             "step_mb": round(profile.step_bytes(model, 256) / 1e6, 1),
             "tokens_per_s": {str(b): round(_tokens_per_s(model, b, new), 1) for b in batches}}
        if dtype == "bfloat16":  # the loop drafting 0..4 tokens with an EAGLE head of one layer
            head = hidden_drafter(model, "eagle", head_params("eagle", config, 4,
                                                              jax.random.key(1)), depth=4)
            r["loop_ms_by_gamma"] = [float(f"{t:.4g}") for t in profile.loop_ms(
                model, head, 2 if dry_run else 4, tokens=16 if dry_run else 6,
                rounds=1 if dry_run else 3)]
        out["dtypes"][dtype] = r
        print(dtype, json.dumps(r), flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def report(r: dict) -> str:
    lines = [f"# Device benchmark: {r['device']} ({r['backend']}, jax {r['jax']})", "",
             f"Model: {r['model']}. {r['seconds']} s.", "",
             "| dtype | MB a step | ms at S = " + ", ".join(next(iter(
                 r["dtypes"].values()))["target_ms"]) + " | tokens/s by batch |",
             "|---|---|---|---|"]
    for dtype, d in r["dtypes"].items():
        lines.append(f"| {dtype} | {d['step_mb']} | "
                     + " / ".join(f"{t:.2f}" for t in d["target_ms"].values()) + " | "
                     + ", ".join(f"{b}: {t}" for b, t in d["tokens_per_s"].items()) + " |")
    loop = r["dtypes"]["bfloat16"]["loop_ms_by_gamma"]
    steps = (", ".join(f"{g}: {t / loop[0]:.2f}" for g, t in enumerate(loop)) if loop[0] > 0
             else "too fast to time here")  # a tiny model's step is below the timer's noise
    lines += ["", "bfloat16 decode-loop step drafting g tokens with an EAGLE head, in plain "
              "steps: " + steps]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for results.json and report.md")
    p.add_argument("--dry-run", action="store_true", help="a tiny model: checks the script")
    a = p.parse_args(argv)
    r = run(a.dry_run)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(r, indent=1))
    (out / "report.md").write_text(report(r))
    print(report(r))


if __name__ == "__main__":
    main()
