"""Self-distillation: the target answers the training prompts at several temperatures.

The work is cut into shards, one per (temperature, block of `block_size` prompt indices), each
generated with its own deterministic seed and written whole through a temporary file and a rename.
A killed job therefore leaves only complete shards, and a rerun skips them: no duplicates, no
gaps, and the same output as an uninterrupted run. A manifest pins the settings a rerun must share.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from jaxspec.decoding.runner import encode_prompts, generate
from jaxspec.errors import UserError
from jaxspec.files import write_atomic

MANIFEST = "manifest.json"


def shard_name(t_idx: int, block: int) -> str:
    return f"t{t_idx}-b{block:06d}.jsonl"


def block_seed(seed: int, t_idx: int, block: int) -> int:
    """A seed per shard, independent of which shards ran before."""
    return int(np.random.SeedSequence([seed, t_idx, block]).generate_state(1)[0] >> 1)


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
    `process_count`-th shard."""
    from tqdm.auto import tqdm

    generate_fn = generate_fn or generate
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompt_ids = encode_prompts(target, list(prompts), chat)
    digest = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()
    _check_manifest(out_dir, {"num_prompts": len(prompts), "prompts_sha256": digest,
                              "temperatures": [float(t) for t in temperatures],
                              "block_size": block_size, "batch_size": batch_size,
                              "max_new_tokens": max_new_tokens, "seed": seed,
                              "top_k": top_k, "top_p": top_p, "stop": stop})
    num_blocks = -(-len(prompts) // block_size)
    shards = [(t, b) for t in range(len(temperatures)) for b in range(num_blocks)]
    todo = [(t, b) for i, (t, b) in enumerate(shards)
            if i % process_count == process_index and not (out_dir / shard_name(t, b)).exists()]
    bar = tqdm(total=sum(len(range(b * block_size, min((b + 1) * block_size, len(prompts))))
                         for _, b in todo), desc="distill", unit="prompt", file=sys.stderr)
    tokens, t0 = 0, time.perf_counter()
    for t_idx, block in todo:
        temperature = float(temperatures[t_idx])
        lines = []
        block_end = min((block + 1) * block_size, len(prompts))
        for start in range(block * block_size, block_end, batch_size):
            end = min(start + batch_size, block_end)
            out = generate_fn(target, prompt_ids[start:end], max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=block_seed(seed, t_idx, block) + start, stop=stop,
                              chat=False)
            for i, (resp_ids, text) in enumerate(zip(out.token_ids, out.texts)):
                lines.append(json.dumps({
                    "id": start + i, "prompt": prompts[start + i],
                    "prompt_ids": prompt_ids[start + i], "response": text,
                    "response_ids": [int(x) for x in resp_ids], "temperature": temperature,
                    "num_tokens": len(resp_ids)}, ensure_ascii=False) + "\n")
                tokens += len(resp_ids)
            bar.update(end - start)
            bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - t0):.1f}")
        write_atomic(out_dir / shard_name(t_idx, block), "".join(lines))
    bar.close()
    return out_dir


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
            records.extend(json.loads(line) for line in
                           (out_dir / n).read_text(encoding="utf-8").splitlines())
    return records
