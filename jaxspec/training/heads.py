"""Training hidden-state drafters (decoding/hidden.py) with the trainer: rows, the target's
features cached on disk, the head's loss.

The target is frozen, so its features are computed once per dataset and cached
(`<dir>/features-*.npy`, bfloat16 bits, written whole by blocks so a killed run resumes), rather
than in every training step: one row of 129 tokens costs a target forward (~100M body
parameters) against a one-layer head's forward and backward.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.decoding.hidden import HiddenSpec
from jaxspec.errors import UserError
from jaxspec.files import write_atomic
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward
from jaxspec.training.data import Example

_BLOCK = 256  # rows per features file


def example_rows(examples: Sequence[Example], seq_len: int, pad_id: int):
    """One example per row of seq_len + 1 tokens (features must not see another example):
    longer examples keep their last seq_len + 1 tokens (the response), shorter are padded with
    mask 0. Returns tokens_NxL, mask_NxL (int32)."""
    L = seq_len + 1
    tokens = np.full((len(examples), L), pad_id, np.int32)
    mask = np.zeros((len(examples), L), np.int32)
    for i, (ids, m) in enumerate(examples):
        ids, m = list(ids)[-L:], list(m)[-L:]
        tokens[i, :len(ids)], mask[i, :len(m)] = ids, m
    return tokens, mask


def row_lengths(mask_NxL: np.ndarray) -> np.ndarray:
    """Tokens each row needs: through its last loss target."""
    L = mask_NxL.shape[1]
    return np.where(mask_NxL.any(1), L - np.argmax(mask_NxL[:, ::-1] > 0, axis=1), 1)


def target_features(target, tokens_NxL: np.ndarray, cache_dir: str | Path,
                    lengths_N: np.ndarray | None = None, batch_size: int = 16,
                    bucket: int = 32) -> np.ndarray:
    """The target's last-layer hidden states [N, L, D] (bfloat16) over each row, cached in
    `<cache_dir>/<hash of the rows>/` (shared by every head trained on the same rows), computed
    block by block when missing. Rows are run shortest first in batches cut to a multiple of
    `bucket` past their longest `lengths_N` (features past a row's length are zero), so the cost
    follows the real tokens, with at most L / bucket compiled shapes."""
    N, L = tokens_NxL.shape
    lengths_N = np.full(N, L) if lengths_N is None else np.asarray(lengths_N)
    digest = hashlib.sha256(tokens_NxL.tobytes() + lengths_N.tobytes()).hexdigest()[:16]
    directory = Path(cache_dir) / digest
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"rows": int(N), "length": int(L), "tokens": digest, "target": target.name,
                "dtype": str(target.params["embed"].dtype)}
    mpath = directory / "manifest.json"
    if mpath.exists() and json.loads(mpath.read_text()) != manifest:
        raise UserError(f"{directory} caches features of another target ({mpath}); delete it "
                        f"or use another directory")
    write_atomic(mpath, json.dumps(manifest))
    c = target.config
    fwd = jax.jit(lambda p, t: forward(p, c, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape),
                                       init_cache(c, t.shape[0], t.shape[1]), features=True)[2]
                  .astype(jnp.bfloat16))
    from tqdm.auto import tqdm

    blocks = []
    for b in tqdm(range(0, N, _BLOCK), desc="target features", unit="block", file=sys.stderr):
        path = directory / f"features-{b // _BLOCK:05d}.npy"
        if not path.exists():
            rows, lens = tokens_NxL[b:b + _BLOCK], lengths_N[b:b + _BLOCK]
            feats = np.zeros((len(rows), L, c.hidden_size), ml_dtypes.bfloat16)
            order = np.argsort(lens, kind="stable")
            for i in range(0, len(rows), batch_size):
                idx = order[i:i + batch_size]
                n = min(L, -(-int(lens[idx].max()) // bucket) * bucket)
                batch = np.concatenate([rows[idx, :n], np.repeat(rows[idx[-1:], :n],
                                                                 batch_size - len(idx), 0)])
                feats[idx, :n] = np.asarray(fwd(target.params, batch))[:len(idx)]
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, feats.view(np.uint16))
            tmp.replace(path)
        blocks.append(np.load(path).view(ml_dtypes.bfloat16))
    return np.concatenate(blocks)


def head_loss(spec: HiddenSpec, to_head_V: np.ndarray, reg_weight: float = 1.0,
              bf16: bool = False):
    """`loss(head, shared, batch) -> (loss, targets)` for the trainer: `shared` are the target's
    frozen arrays (hidden.shared_params), passed where a teacher's params go; with `bf16` the
    head's products run in bfloat16 (its params stay float32)."""
    to_head_V = jnp.asarray(to_head_V)

    def loss(head, shared, batch):
        if bf16:
            head = jax.tree.map(lambda p: p.astype(jnp.bfloat16), head)
        params = {"head": head, "shared": shared}
        return spec.loss(params, batch["features"].astype(jnp.float32), batch["tokens"],
                         batch["mask"].astype(bool), to_head_V, reg_weight)

    return loss
