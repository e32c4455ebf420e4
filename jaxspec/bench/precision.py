"""Greedy agreement of one weight precision with another (bfloat16 with float32, int8 with
bfloat16): how often the two decode the same text.

    python -m jaxspec.bench.precision --model gemma3-270m \
        --questions ../shared/data/specbench/deen_question.jsonl --limit 20 \
        --reference bfloat16 --dtype int8
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jaxspec.decoding.api import generate
from jaxspec.loading import load
from jaxspec.questions import read_questions


def agreement(model_name: str, prompts, max_new_tokens: int = 32, template: str = "{prompt}",
              chat: bool = False, stop=None, reference: str = "float32",
              dtype: str = "bfloat16") -> dict:
    """Per prompt, the greedy outputs of `reference` and `dtype` weights: the share of identical
    outputs and the mean length of the common prefix over the reference output's length."""
    outs = {}
    for d in (reference, dtype):
        model = load(model_name, dtype=d)
        outs[d] = [generate(model, [template.format(prompt=p)], max_new_tokens=max_new_tokens,
                                chat=chat, stop=stop).token_ids[0] for p in prompts]
    prefix = []
    ref, other = outs.values()
    for a, b in zip(ref, other):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same / max(len(a), 1) if a != b else 1.0)
    return {"model": model_name, "reference": reference, "dtype": dtype, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "identical": float(np.mean([a == b for a, b in zip(ref, other)])),
            "common_prefix": float(np.mean(prefix))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--questions", required=True, help="Spec-Bench question.jsonl")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--template", default="{prompt}")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--stop")
    p.add_argument("--reference", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "int8"))
    a = p.parse_args(argv)
    prompts = [q["turns"][0] for q in read_questions(a.questions)[:a.limit]]
    print(json.dumps(agreement(a.model, prompts, a.max_new_tokens, a.template, a.chat, a.stop,
                               a.reference, a.dtype)))


if __name__ == "__main__":
    main()
