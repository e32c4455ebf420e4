"""Distillation throughput against batch size: prompts/s and generated tokens/s of continuous
batching (what `jaxspec distill` runs) and, with `--modes refill fixed`, of fixed batches (the
previous scheme: each batch decodes until its longest row stops), to pick `distill.batch_size`;
`--modes labels`: training labels at prefill speed instead (`heads.target_features` with
labels: the target's features and greedy next token at every prompt position, no generation),
tokens labelled per second.

    python -m jaxspec.bench.distill_speed --model gemma3-270m --dtype bfloat16 \
        --batch-sizes 16 32 64 128 [--num-prompts 256] [--max-new-tokens 64] [--stop '\\n'] \
        [--prompts runs/deen_gemma3_cpu/distill/prompts.json] [--modes refill fixed] [--profile]

Prompts: `--prompts` (a recipe's cached prompts.json, a JSON list of strings, or a text file of
one prompt a line), else German sentences in the one-shot translation template of
configs/deen_gemma3_cpu.yaml; cycled to `--num-prompts`. Each setting first decodes one batch of
prompts (compiling), then is timed over all prompts: compilation is excluded. `--profile` then
decodes one more batch of prompts per batch size under `jax.profiler` and prints the XLA ops'
time and the share of it spent in matrix products (`bench.op_profile`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TEMPLATE = ("Translate German to English:Ich trinke jeden Morgen einen Kaffee.\nEnglish: I drink "
            "a coffee every morning.\nTranslate German to English:{sentence}\nEnglish:")
SENTENCES = (
    "Der Zug nach Berlin hat heute eine Stunde Verspätung.", "Es regnet seit drei Tagen.",
    "Die Regierung hat ein neues Gesetz zum Klimaschutz beschlossen.", "Wie spät ist es?",
    "Am Wochenende fahren wir mit den Kindern ans Meer.", "Das Museum ist montags geschlossen.",
    "Die Mannschaft gewann das Spiel nach einem späten Tor mit zwei zu eins.", "Danke schön.",
    "Ich habe meinen Schlüssel im Büro vergessen.", "Der neue Film läuft ab Donnerstag im Kino.",
    "Die Preise für Lebensmittel sind im letzten Jahr stark gestiegen.", "Guten Morgen!",
    "Kannst du mir bitte das Salz geben?", "In der Altstadt gibt es viele kleine Cafés.",
    "Forscher haben in der Antarktis eine neue Bakterienart entdeckt.", "Wir sehen uns morgen.",
)


def load_prompts(path: str | None, num: int) -> list[str]:
    if path is None:
        prompts = [TEMPLATE.format(sentence=s) for s in SENTENCES]
    else:
        text = Path(path).read_text(encoding="utf-8")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = [line for line in text.splitlines() if line.strip()]
        prompts = obj["items"] if isinstance(obj, dict) else obj
    if not prompts:
        raise SystemExit(f"no prompts in {path}")
    return [prompts[i % len(prompts)] for i in range(num)]


def _fixed(model, ids, batch_size, **kw):
    from jaxspec.decoding.api import generate

    for start in range(0, len(ids), batch_size):
        yield from generate(model, ids[start:start + batch_size], seed=start, **kw).token_ids


def _refill(model, ids, batch_size, *, cache_slots, **kw):
    from jaxspec.decoding.api import stream_generate

    seeds = np.arange(len(ids))
    for _, tokens in stream_generate(model, ids, seeds, batch_size=batch_size,
                                     cache_slots=cache_slots, **kw):
        yield tokens


def _labels(model, ids, batch_size, **_):
    from jaxspec.training import heads

    lengths = np.array([len(p) for p in ids])
    rows = np.full((len(ids), lengths.max()), model.config.pad_token_id, np.int32)
    for row, p in zip(rows, ids):
        row[:len(p)] = p
    with tempfile.TemporaryDirectory() as d:
        heads.target_features(model, rows, d, lengths, batch_size, labels=True)
    yield from ids


def measure(model, prompts, batch_sizes, modes=("refill",), max_new_tokens: int = 64,
            temperature: float = 0.0, stop="\n", chat: bool = False, profile: bool = False,
            out=sys.stdout) -> list[dict]:
    """One row per (mode, batch size): prompts, tokens, seconds, prompts/s, tokens/s; with
    `profile`, also `ops` (`op_profile.trace` of one more batch of prompts)."""
    from jaxspec.bench import op_profile
    from jaxspec.decoding.runner import DECODER, cache_len, encode_prompts

    ids = encode_prompts(model, list(prompts), chat)
    slots = cache_len(np.array([len(p) for p in ids]), np.array([max_new_tokens]), 0,
                      model.config.max_position)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop=stop)
    print(f"{'mode':>6} {'batch':>5} {'prompts':>7} {'tokens':>7} {'seconds':>8} "
          f"{'prompts/s':>9} {'tokens/s':>9}", file=out, flush=True)
    rows = []
    for mode in modes:
        for batch_size in batch_sizes:
            run = {"refill": _refill, "fixed": _fixed, "labels": _labels}[mode]
            extra = dict(cache_slots=slots) if mode == "refill" else {}
            for _ in run(model, ids[:batch_size], batch_size, **kw, **extra):  # compile
                pass
            t0 = time.perf_counter()
            tokens = sum(len(t) for t in run(model, ids, batch_size, **kw, **extra))
            secs = time.perf_counter() - t0
            row = dict(mode=mode, batch_size=batch_size, prompts=len(ids), tokens=tokens,
                       seconds=secs, prompts_per_s=len(ids) / secs, tokens_per_s=tokens / secs)
            rows.append(row)
            print(f"{mode:>6} {batch_size:>5} {len(ids):>7} {tokens:>7} {secs:>8.1f} "
                  f"{row['prompts_per_s']:>9.2f} {row['tokens_per_s']:>9.1f}", file=out,
                  flush=True)
            if profile and mode != "labels":
                row["ops"] = op_profile.trace(
                    lambda: list(run(model, ids[:batch_size], batch_size, **kw, **extra)),
                    DECODER.hlo_texts)
                print(op_profile.format_trace(row["ops"]), file=out, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m jaxspec.bench.distill_speed",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a registered name or a path")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--modes", nargs="+", default=["refill"], choices=("refill", "fixed", "labels"))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompts", help="prompts.json of a recipe, a JSON list, or a text file")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--stop", default="\n", help="a stop string ('' for none)")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also the share of matrix products in the XLA ops' time")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    from jaxspec.loading import load

    model = load(args.model, dtype=args.dtype)
    stop = args.stop.replace("\\n", "\n").replace("\\t", "\t") or None  # as typed in a shell
    rows = measure(model, load_prompts(args.prompts, args.num_prompts), args.batch_sizes,
                   args.modes, args.max_new_tokens, args.temperature, stop, args.chat,
                   args.profile)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
