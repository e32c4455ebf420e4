"""Drafter initialisation: random, or cut from the target; optionally a reduced output vocabulary.

A reduced head predicts only `vocab_ids` (head index -> full vocabulary id, ascending), chosen as
the most frequent ids of the distilled text. The ids are saved in the checkpoint's metadata
(`jaxspec.json`, key "vocab_ids"), so they are written atomically with the params.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoints import store
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.models.params import init_params


def random_init(config: ModelConfig, seed: int = 0) -> dict:
    """Random params of a config (jitted: one compile instead of one per op)."""
    return jax.jit(init_params, static_argnums=0)(config, jax.random.key(seed))


def from_target(target_config: ModelConfig, target_params: dict,
                num_layers: int) -> tuple[ModelConfig, dict]:
    """A drafter of the target's width: its embeddings, first `num_layers` layers, final norm and
    output head."""
    if not 0 < num_layers <= target_config.num_layers:
        raise UserError(f"num_layers must be in [1, {target_config.num_layers}], got {num_layers}")
    config = target_config.replace(num_layers=num_layers,
                                   layer_types=target_config.layer_types[:num_layers])
    params = dict(target_params)
    params["layers"] = list(target_params["layers"][:num_layers])
    return config, params


def frequent_vocab(token_ids: Iterable[Sequence[int]], size: int, vocab_size: int,
                   always: Sequence[int] = ()) -> np.ndarray:
    """The `size` most frequent ids (ties to the lower id), always including `always` (EOS);
    ascending int32."""
    always = sorted(set(int(i) for i in always))
    if len(always) > size:
        raise UserError(f"head of {size} cannot hold the {len(always)} ids it must include")
    if size > vocab_size:
        raise UserError(f"head_vocab_size {size} exceeds the vocabulary ({vocab_size})")
    counts = np.zeros(vocab_size, np.int64)
    for ids in token_ids:
        counts += np.bincount(np.asarray(ids, np.int64), minlength=vocab_size)[:vocab_size]
    counts[always] = -1  # placed first below, then skipped
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    rest = [int(i) for i in order if counts[i] >= 0][:size - len(always)]
    return np.asarray(sorted(always + rest), np.int32)


def reduce_head(config: ModelConfig, params: dict,
                vocab_ids: np.ndarray) -> tuple[ModelConfig, dict]:
    """Keep only the head rows of `vocab_ids`; the embedding stays full."""
    if config.head_vocab_size is not None:
        raise UserError("the head is already reduced")
    vocab_ids = np.asarray(vocab_ids, np.int32)
    if vocab_ids.ndim != 1 or vocab_ids.min() < 0 or vocab_ids.max() >= config.vocab_size:
        raise UserError(f"vocab_ids must be a 1-D array of ids in [0, {config.vocab_size})")
    head_VxD = params["lm_head"] if "lm_head" in params else params["embed"]
    params = dict(params, lm_head=jnp.asarray(head_VxD[vocab_ids]))
    return config.replace(tie_embeddings=False, head_vocab_size=len(vocab_ids)), params


def save_drafter(path: str | os.PathLike, config: ModelConfig, params: dict, tokenizer=None,
                 vocab_ids: np.ndarray | None = None, extra: dict | None = None,
                 embed_from: str | None = None) -> Path:
    """A jaxspec checkpoint (loadable by `jaxspec.load`) holding the head's vocab ids.
    `embed_from` (a model name or path) replaces a frozen copy of that model's embedding."""
    extra = dict(extra or {})
    if vocab_ids is not None:
        extra["vocab_ids"] = [int(i) for i in vocab_ids]
    if embed_from is not None:  # the target's embedding, unchanged: store a reference
        extra["embed_from"] = embed_from
        params = {k: v for k, v in params.items() if k != "embed"}
    return store.save(path, params, config, tokenizer, extra=extra)
