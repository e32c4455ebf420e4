"""Training hidden-state drafters (drafters/hidden.py) with the trainer: rows, the target's
features cached on disk, the head's loss.

The target is frozen, so its features are computed once per dataset and cached
(`<dir>/features-*.npy`, bfloat16 bits, written whole by blocks so a killed run resumes), rather
than in every training step: one row of 129 tokens costs a target forward (~100M body
parameters) against a one-layer head's forward and backward.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxspec.decoding.sampling import argmax
from jaxspec.drafters.head import HiddenSpec
from jaxspec.errors import UserError
from jaxspec.files import write_atomic
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward, head as output_head
from jaxspec.training.data import Example

_BLOCK = 256  # rows per features file


def example_rows(examples: Sequence[Example], seq_len: int, pad_id: int):
    """One example per row of seq_len + 1 tokens (features must not see another example):
    longer examples keep their last seq_len + 1 tokens (the response), shorter are padded with
    mask 0. Returns tokens_RxL, mask_RxL (int32)."""
    L = seq_len + 1
    tokens = np.full((len(examples), L), pad_id, np.int32)
    mask = np.zeros((len(examples), L), np.int32)
    for i, (ids, m) in enumerate(examples):
        ids, m = list(ids)[-L:], list(m)[-L:]
        tokens[i, :len(ids)], mask[i, :len(m)] = ids, m
    return tokens, mask


def row_lengths(mask_RxL: np.ndarray) -> np.ndarray:
    """Tokens each row needs: through its last loss target."""
    L = mask_RxL.shape[1]
    return np.where(mask_RxL.any(1), L - np.argmax(mask_RxL[:, ::-1] > 0, axis=1), 1)


def target_features(target, tokens_RxL: np.ndarray, cache_dir: str | Path,
                    lengths_R: np.ndarray | None = None, batch_size: int = 16,
                    bucket: int = 32, labels: bool = False, feature_layer: int | None = None):
    """The target's last-layer hidden states [R, L, D] (bfloat16; with `feature_layer`, the
    input of that layer, as speculative streams read them) over each row, cached in
    `<cache_dir>/<hash of the rows>/` (shared by every head trained on the same rows), computed
    block by block when missing. Rows are run shortest first in batches cut to a multiple of
    `bucket` past their longest `lengths_R` (features past a row's length are zero), so the cost
    follows the real tokens, with at most L / bucket compiled shapes. With `labels`, returns
    (features, labels [N, L] int32): the target's greedy next token after each position, from
    the same forward (training labels at prefill speed, no generation)."""
    N, L = tokens_RxL.shape
    lengths_R = np.full(N, L) if lengths_R is None else np.asarray(lengths_R)
    digest = hashlib.sha256(tokens_RxL.tobytes() + lengths_R.tobytes()
                            + str(feature_layer).encode() * (feature_layer is not None)
                            ).hexdigest()[:16]
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
    from tqdm.auto import tqdm

    blocks, label_blocks = [], []
    for b in tqdm(range(0, N, _BLOCK), desc="target features", unit="block", file=sys.stderr):
        path = directory / f"features-{b // _BLOCK:05d}.npy"
        lpath = directory / f"labels-{b // _BLOCK:05d}.npy"
        if not path.exists() or (labels and not lpath.exists()):
            rows, lens = tokens_RxL[b:b + _BLOCK], lengths_R[b:b + _BLOCK]
            feats = np.zeros((len(rows), L, c.hidden_size), ml_dtypes.bfloat16)
            ids = np.zeros((len(rows), L), np.int32)
            order = np.argsort(lens, kind="stable")
            for i in range(0, len(rows), batch_size):
                idx = order[i:i + batch_size]
                n = min(L, -(-int(lens[idx].max()) // bucket) * bucket)
                batch = np.concatenate([rows[idx, :n], np.repeat(rows[idx[-1:], :n],
                                                                 batch_size - len(idx), 0)])
                f, t = _features_fn(c, labels, bucket, feature_layer)(target.params, batch)
                feats[idx, :n] = np.asarray(f)[:len(idx)]
                if labels:
                    ids[idx, :n] = np.asarray(t)[:len(idx)]
            if labels:
                _save(lpath, ids)
            _save(path, feats.view(np.uint16))
        blocks.append(np.load(path).view(ml_dtypes.bfloat16))
        if labels:
            label_blocks.append(np.load(lpath))
    if labels:
        return np.concatenate(blocks), np.concatenate(label_blocks)
    return np.concatenate(blocks)


@functools.lru_cache(maxsize=8)
def _features_fn(c, labels: bool, bucket: int, feature_layer: int | None):
    """Rows -> (bfloat16 features, the greedy next token after each position or None)."""
    @jax.jit
    def fwd(p, t_BxS):
        B, S = t_BxS.shape
        pos_BxS = jnp.broadcast_to(jnp.arange(S), t_BxS.shape)
        f_BxSxD = forward(p, c, t_BxS, pos_BxS, init_cache(c, B, S), features=True,
                          feature_layer=feature_layer)[2]
        x_BxSxD = f_BxSxD
        if feature_layer is not None and labels:  # the last layer's output: the top layers
            top = tuple(range(feature_layer, c.num_layers))
            x_BxSxD = forward(p, c, None, pos_BxS, init_cache(c, B, S, num_layers=len(top)), top,
                              features=True, inputs_BxSxD=f_BxSxD)[2]
        if not labels:
            return f_BxSxD.astype(jnp.bfloat16), None
        # The head over `bucket` positions at a time: [B, S, vocab] logits at once are GBs.
        C = -(-S // bucket)
        x_BxCbxD = jnp.pad(x_BxSxD, ((0, 0), (0, C * bucket - S), (0, 0)))
        x_CxBxbxD = x_BxCbxD.reshape(B, C, bucket, -1).swapaxes(0, 1)
        ids_CxBxb = jax.lax.map(lambda x: argmax(output_head(p, c, x)), x_CxBxbxD)
        return f_BxSxD.astype(jnp.bfloat16), ids_CxBxb.swapaxes(0, 1).reshape(B, -1)[:, :S]

    return fwd


def _save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, array)
    tmp.replace(path)


def head_loss(spec: HiddenSpec, to_head_V: np.ndarray, reg_weight: float = 1.0,
              bf16: bool = False, unroll: int = 1):
    """`loss(head, shared, batch) -> (loss, targets)` for the trainer: `shared` are the target's
    frozen arrays (`spec.shared`), passed where a teacher's params go; with `bf16` the
    head's products run in bfloat16 (its params stay float32); EAGLE trains `unroll` drafts
    deep on its own predictions. A batch with "labels" (`target_features(labels=True)`) is
    trained to draft the target's greedy tokens rather than the text's."""
    to_head_V = jnp.asarray(to_head_V)

    def loss(head, shared, batch):
        if bf16:
            head = jax.tree.map(lambda p: p.astype(jnp.bfloat16), head)
        params = {"head": head, "shared": shared}
        return spec.loss(params, batch["features"].astype(jnp.float32), batch["tokens"],
                         batch["mask"].astype(bool), to_head_V, reg_weight, unroll,
                         batch.get("labels"))

    return loss


def agreement(spec: HiddenSpec, params, features_RxLxD, tokens_RxL, mask_RxL, steps: int,
              batch_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced top-1 agreement of a hidden-state drafter (`params` as `hidden_drafter`
    builds them) by draft position over the masked tokens of rows: (hits [steps],
    counts [steps]) from `HiddenSpec.forced_logits`. Greedy decoding accepts draft j + 1
    exactly when it agrees, given drafts 1..j were accepted: hits / counts is the acceptance
    by position on that text."""
    @jax.jit
    def top1(f, t):
        return [params["vocab_ids"][jnp.argmax(lg, -1)]
                for lg in spec.forced_logits(params, f.astype(jnp.float32), t, steps)]

    N, L = tokens_RxL.shape
    hits, counts = np.zeros(steps, np.int64), np.zeros(steps, np.int64)
    for i in range(0, N, batch_size):
        t, m = tokens_RxL[i:i + batch_size], mask_RxL[i:i + batch_size] > 0
        pad = ((0, batch_size - len(t)),)
        drafts = top1(np.pad(features_RxLxD[i:i + batch_size], pad + ((0, 0), (0, 0))),
                      np.pad(t, pad + ((0, 0),)))
        for j, d in enumerate(drafts):
            S = L - 2 - j  # draft j + 1 at p is for token p + j + 2
            hits[j] += np.sum((np.asarray(d)[:len(t), :S] == t[:, 2 + j:]) & m[:, 2 + j:])
            counts[j] += m[:, 2 + j:].sum()
    return hits, counts
