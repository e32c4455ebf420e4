"""Held-out source sentences for a language pair: text the target writes itself from a seed no
recipe uses, minus every sentence a training prompt contains, as a Spec-Bench question file.

    python -m jaxspec.bench.heldout --language fr --exclude runs/fren_gemma3_eagle/distill/prompts.json \
        --out data/heldout/fren_question.jsonl

Sentences are those `training.data.self_generated` keeps (distinct, language-checked), between
--min-chars and --max-chars long; the file is written once, atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxspec.errors import UserError
from jaxspec.files import write_atomic


def held_out(sentences: list[str], exclude: list[str], num: int, min_chars: int,
             max_chars: int) -> list[str]:
    """The first `num` sentences within the length limits that no text of `exclude` contains."""
    seen = "\n".join(exclude)
    kept = [s for s in sentences if min_chars <= len(s) <= max_chars and s not in seen]
    if len(kept) < num:
        raise UserError(f"only {len(kept)} held-out sentences of {len(sentences)}; write more "
                        f"text (--num-texts)")
    return kept[:num]


def questions(sentences: list[str], language: str) -> list[dict]:
    from jaxspec.training.data import translation_prompt

    return [{"question_id": i, "category": f"{language}en",
             "turns": [translation_prompt(s, language)]} for i, s in enumerate(sentences)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--language", required=True, help="ISO 639-1 code of the source language")
    p.add_argument("--num", type=int, default=40)
    p.add_argument("--num-texts", type=int, default=48)
    p.add_argument("--seed", type=int, default=1001)
    p.add_argument("--min-chars", type=int, default=20)
    p.add_argument("--max-chars", type=int, default=200)
    p.add_argument("--exclude", nargs="*", default=[],
                   help="JSON files of training prompts ({'items': [...]} as recipes cache them)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from jaxspec.loading import load
    from jaxspec.training.data import self_generated

    exclude = []
    for path in a.exclude:
        exclude += json.loads(Path(path).read_text(encoding="utf-8"))["items"]
    model = load(a.model, dtype=a.dtype)
    records = self_generated(model, a.language, a.num_texts, seed=a.seed, max_new_tokens=80,
                             batch_size=16)
    chosen = held_out([r["text"] for r in records], exclude, a.num, a.min_chars, a.max_chars)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps(q, ensure_ascii=False) + "\n"
                              for q in questions(chosen, a.language)))
    print(f"{out}: {len(chosen)} {a.language} sentences", file=sys.stderr)


if __name__ == "__main__":
    main()
