"""Self-distillation: the target answers the training prompts at several temperatures.

The work is cut into shards, one per (temperature, block of `block_size` prompt indices), each
generated with its own deterministic seed and written whole through a temporary file and a rename.
A killed job therefore leaves only complete shards, and a rerun skips them: no duplicates, no
gaps, and the same output as an uninterrupted run. A manifest pins the settings a rerun must share.

Generation is continuously batched (`runner.Decoder.stream`): `batch_size` rows decode together
and a finished row's slot takes the next prompt at once (across shards of one temperature), so no
row waits for the longest one of its batch. Each prompt samples with its own key, derived from
(shard seed, prompt index): its response does not depend on the slot or step it lands in, and a
greedy response is that of `generate` on the prompt alone. A target split over a mesh of this
process's devices (`loading.shard`; `recipe.run_distill` does so) decodes its rows data parallel
over the mesh and writes the same shards.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from jaxspec.decoding import stops
from jaxspec.decoding.api import stream_generate
from jaxspec.decoding.runner import cache_len, decode_text, encode_prompts
from jaxspec.errors import UserError
from jaxspec.files import read_jsonl, write_atomic

MANIFEST = "manifest.json"


def shard_name(t_idx: int, block: int) -> str:
    return f"t{t_idx}-b{block:06d}.jsonl"


def block_seed(seed: int, t_idx: int, block: int) -> int:
    """A seed per shard, independent of which shards ran before."""
    return int(np.random.SeedSequence([seed, t_idx, block]).generate_state(1)[0] >> 1)


def prompt_seed(shard_seed: int, index: int) -> int:
    """The key seed (uint32) of prompt `index` in the shard seeded `shard_seed`."""
    return int(np.random.SeedSequence([shard_seed, index]).generate_state(1)[0])


def _check_manifest(out_dir: Path, manifest: dict) -> None:
    path = out_dir / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        if old != manifest:
            diff = sorted(k for k in manifest.keys() | old.keys() if old.get(k) != manifest.get(k))
            raise UserError(f"{out_dir} holds a distillation with other settings ({diff}); "
                            f"use a new directory")
    else:
        write_atomic(path, json.dumps(manifest, indent=2))


def distill(target, prompts: Sequence[str], out_dir: str | os.PathLike,
            temperatures: Sequence[float] = (0.0, 0.3, 0.7, 1.0), max_new_tokens: int = 128,
            block_size: int = 64, batch_size: int = 8, seed: int = 0, chat: bool = False,
            top_k: int | None = None, top_p: float | None = None, stop=None,
            generate_fn: Callable | None = None, process_index: int = 0,
            process_count: int = 1) -> Path:
    """Generate the target's responses to `prompts` at each temperature into JSONL shards under
    `out_dir`, skipping shards already there. Records: id (prompt index), prompt, prompt_ids,
    response, response_ids, temperature, num_tokens. With several processes, each takes every
    `process_count`-th shard.

    By default `batch_size` rows decode at once with continuous batching (see the module
    docstring). A `generate_fn` (called like `generate` on a list of prompts) instead runs fixed
    batches of `batch_size` prompts, each seeded `block_seed(...) + its first index`."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompt_ids = encode_prompts(target, list(prompts), chat)
    digest = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()
    manifest = {"num_prompts": len(prompts), "prompts_sha256": digest,
                "temperatures": [float(t) for t in temperatures],
                "block_size": block_size, "batch_size": batch_size,
                "max_new_tokens": max_new_tokens, "seed": seed,
                "top_k": top_k, "top_p": top_p, "stop": stop}
    if generate_fn is None and any(float(t) > 0 for t in temperatures):
        # Samples come from per-prompt keys, not from the fixed batches' seeds: a distillation
        # begun the other way cannot be finished this way (greedy output is the same in both).
        manifest["sampling_keys"] = "per-prompt"
    _check_manifest(out_dir, manifest)
    num_blocks = -(-len(prompts) // block_size)
    shards = [(t, b) for t in range(len(temperatures)) for b in range(num_blocks)]
    todo = [(t, b) for i, (t, b) in enumerate(shards)
            if i % process_count == process_index and not (out_dir / shard_name(t, b)).exists()]
    bar = tqdm(total=sum(len(_block_range(b, block_size, len(prompts))) for _, b in todo),
               desc="distill", unit="prompt", file=sys.stderr)
    progress = _Progress(bar)
    record = functools.partial(_record, prompts, prompt_ids)
    if generate_fn is None:
        # One cache length for every prompt, whichever shards are left: a resumed run decodes
        # with the same shapes as an uninterrupted one.
        slots = cache_len(np.array([len(p) for p in prompt_ids]), np.array([max_new_tokens]), 0,
                          target.config.max_position)
        for t_idx in sorted({t for t, _ in todo}):
            _stream_shards(target, prompt_ids, out_dir, t_idx, [b for t, b in todo if t == t_idx],
                           float(temperatures[t_idx]), record, progress, seed=seed,
                           block_size=block_size, batch_size=batch_size,
                           max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p, stop=stop,
                           cache_slots=slots)
    else:
        for t_idx, block in todo:
            temperature = float(temperatures[t_idx])
            lines = []
            rows = _block_range(block, block_size, len(prompts))
            for start in range(rows.start, rows.stop, batch_size):
                end = min(start + batch_size, rows.stop)
                out = generate_fn(target, prompt_ids[start:end], max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_k=top_k, top_p=top_p,
                                  seed=block_seed(seed, t_idx, block) + start, stop=stop,
                                  chat=False)
                for i, (resp_ids, text) in enumerate(zip(out.token_ids, out.texts)):
                    lines.append(record(start + i, resp_ids, text, temperature))
                progress.add(end - start, sum(len(r) for r in out.token_ids))
            write_atomic(out_dir / shard_name(t_idx, block), "".join(lines))
    bar.close()
    return out_dir


def _block_range(block: int, block_size: int, num_prompts: int) -> range:
    return range(block * block_size, min((block + 1) * block_size, num_prompts))


def _record(prompts, prompt_ids, i: int, resp_ids, text: str, temperature: float) -> str:
    return json.dumps({
        "id": i, "prompt": prompts[i], "prompt_ids": prompt_ids[i], "response": text,
        "response_ids": [int(x) for x in resp_ids], "temperature": temperature,
        "num_tokens": len(resp_ids)}, ensure_ascii=False) + "\n"


class _Progress:
    """Prompts done on the bar, and generated tokens per second (since the start) beside it."""

    def __init__(self, bar):
        self.bar, self.tokens, self.t0 = bar, 0, time.perf_counter()

    def add(self, prompts: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.set_postfix(tok_per_s=f"{self.tokens / (time.perf_counter() - self.t0):.1f}",
                             refresh=False)
        self.bar.update(prompts)


def _stream_shards(target, prompt_ids, out_dir: Path, t_idx: int, blocks: list[int],
                   temperature: float, record, progress, *, seed, block_size, batch_size,
                   max_new_tokens, top_k, top_p, stop, cache_slots) -> None:
    """The shards `blocks` of temperature `t_idx` through one continuously batched stream; each
    shard is written as soon as its last prompt finishes."""
    order = [(b, i) for b in blocks for i in _block_range(b, block_size, len(prompt_ids))]
    seeds = [prompt_seed(block_seed(seed, t_idx, b), i) for b, i in order]
    open_shards = {b: {} for b in blocks}  # block -> {prompt index: record line}
    stop_strings = stops.strings(target, stop)  # the text ends before one, as generate's
    stream = stream_generate(target, [prompt_ids[i] for _, i in order], seeds,
                             batch_size=batch_size, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                             cache_slots=cache_slots)
    for k, resp_ids in stream:
        block, i = order[k]
        lines = open_shards[block]
        lines[i] = record(i, resp_ids, decode_text(target, resp_ids, stop_strings), temperature)
        progress.add(1, len(resp_ids))
        if len(lines) == len(_block_range(block, block_size, len(prompt_ids))):
            write_atomic(out_dir / shard_name(t_idx, block),
                         "".join(lines[j] for j in sorted(lines)))
            del open_shards[block]


def read_distilled(out_dir: str | os.PathLike, require_complete: bool = True) -> list[dict]:
    """All records of a distillation directory, in (temperature, prompt) order; raises if
    shards are missing and `require_complete`."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / MANIFEST).read_text())
    num_blocks = -(-manifest["num_prompts"] // manifest["block_size"])
    names = [shard_name(t, b) for t in range(len(manifest["temperatures"]))
             for b in range(num_blocks)]
    missing = [n for n in names if not (out_dir / n).exists()]
    if missing and require_complete:
        raise FileNotFoundError(f"{out_dir}: {len(missing)} of {len(names)} shards missing "
                                f"(first {missing[0]}); rerun the distillation to finish it")
    records = []
    for n in names:
        if (out_dir / n).exists():
            records.extend(obj for _, obj in read_jsonl(out_dir / n))
    return records
