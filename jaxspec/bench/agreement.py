"""Teacher-forced agreement of a hidden-state head against its acceptance when decoding.

At gamma 1 a draft is accepted exactly when the head's first proposal equals the target's
greedy token, so its acceptance rate must match the head's teacher-forced top-1 agreement on
the target's own greedy text (the features of one full forward), up to which positions decoding
happens to draft at. A gap means the incremental drafting state drifts from what was trained.

    python -m jaxspec.bench.agreement --model gemma3-270m --dtype bfloat16 \
        --drafter gemma3-270m-deen-drafter --questions ../shared/data/specbench/deen_question.jsonl
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.api import generate, speculative_generate
from jaxspec.decoding.runner import encode_prompts
from jaxspec.loading import load, parse_drafter
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward
from jaxspec.questions import read_questions


def first_drafts(target, drafter, tokens_1xL) -> np.ndarray:
    """The head's first proposal at every position p of one text, teacher-forced: what it
    drafts for token p + 2 given the target's features up to p and the tokens up to p + 1."""
    spec, params, c = drafter.spec, drafter.params, target.config
    L = tokens_1xL.shape[1]
    pos = jnp.arange(L)[None]
    _, _, f_1xLxD = forward(target.params, c, tokens_1xL, pos, init_cache(c, 1, L),
                            features=True)
    logits = spec.forced_logits(params, f_1xLxD, tokens_1xL, 1)[0]
    return np.asarray(params["vocab_ids"][jnp.argmax(logits, -1)])[0]


def measure(target, drafter, prompts, max_new_tokens: int = 64, stop=None) -> dict:
    """Teacher-forced agreement over every generated position, and gamma-1 acceptance."""
    hits = total = 0
    for p in prompts:
        out = generate(target, [p], max_new_tokens=max_new_tokens, stop=stop)
        prompt_ids = encode_prompts(target, [p], chat=False)[0]
        ids = np.asarray([list(prompt_ids) + list(out.token_ids[0])], np.int32)
        drafts = first_drafts(target, drafter, jnp.asarray(ids))
        # drafts[p] proposes token p + 2; score the generated tokens after the first.
        start = len(prompt_ids) + 1
        hits += int(np.sum(drafts[start - 2:] == ids[0, start:]))
        total += ids.shape[1] - start
    spec = speculative_generate(target, drafter, list(prompts), gamma=1,
                                max_new_tokens=max_new_tokens, stop=stop)
    return {"teacher_forced": hits / max(total, 1), "positions": total,
            "accepted_gamma1": float(spec.acceptance_rate),
            "steps": int(sum(len(a) for a in spec.accept_lengths))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--template", default="Translate German to English:Ich trinke jeden Morgen "
                   "einen Kaffee.\nEnglish: I drink a coffee every morning.\n{prompt}\nEnglish:")
    a = p.parse_args(argv)
    target = load(a.model, dtype=a.dtype)
    drafter = parse_drafter(a.drafter, target)
    prompts = [a.template.format(prompt=q["turns"][0])
               for q in read_questions(a.questions)[:a.limit]]
    print(json.dumps(measure(target, drafter, prompts, a.max_new_tokens, "\n"), indent=2))


if __name__ == "__main__":
    main()
