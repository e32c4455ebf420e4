"""Drafters: propose `gamma` tokens and the distribution each was drawn from.

A `Drafter` pairs a static, hashable `spec` (how to draft) with a `params` pytree (what it drafts
with). Every spec implements

    validate(params, target) -> None                    # raises UserError if it cannot serve
    init(params, tokens_BxT, lengths_B, features_BxTxD) -> state      # prefill; a pytree
    propose(params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
            features_BxTxD) -> draft_BxG, q (a DraftProbs; None when greedy), state

`tokens_BxT` holds each row's text so far in its first `lengths_B` slots. A drafter's cache must
hold positions [0, length - 2) on entry; on exit it may hold more, since the caller rolls back by
lowering lengths. A spec with `reads_features = True` gets the target's hidden states for
positions [0, length - 1) in `features_BxTxD` (hidden.py); for the others it is [B, T, 0]. The
verifier never looks inside the drafter.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.sampling import DraftProbs, Sampling, pick
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import fill_cache, forward


@flax.struct.dataclass
class Drafter:
    """A pytree: `params` are traced, `spec` and `name` are static."""

    params: Any
    spec: Any = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False, default="")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A transformer drafter: a separate model, the target with layers skipped, or a model whose
    head covers a subset of the vocabulary (params["vocab_ids"] maps head index -> token id)."""

    config: ModelConfig
    layers: tuple[int, ...] | None = None
    subset_vocab: bool = False

    def validate(self, params, target) -> None:
        """Refuse a head whose ids would mean other tokens than the target's."""
        tv, dv = target.config.vocab_size, self.config.vocab_size
        if self.subset_vocab:
            ids = np.asarray(params["vocab_ids"])
            if ids.min() < 0 or ids.max() >= tv:
                raise UserError(f"drafter vocab_ids reach {ids.max()}, target vocabulary is {tv}")
            return
        if tv == dv:
            return
        # Heads that differ only by padding past the tokenizer's real vocabulary are accepted.
        real = len(target.tokenizer) if target.tokenizer is not None else None
        if real is None or min(tv, dv) < real:
            raise UserError(f"drafter vocabulary ({dv}) does not match the target's ({tv})")

    def init(self, params, tokens_BxT, lengths_B, features_BxTxD=None):
        B, T = tokens_BxT.shape
        n_layers = len(self.layers) if self.layers is not None else None
        cache = init_cache(self.config, B, T, num_layers=n_layers)
        return fill_cache(params["model"], self.config, tokens_BxT, lengths_B, cache, self.layers)

    def _pick(self, params, key, logits_BxK, sampling: Sampling, vocab_size: int):
        """Draft token [B] and the distribution it was drawn from [B, K] (None when greedy): K
        is the head's vocabulary for a subset head (at params["vocab_ids"]), else the target's."""
        if self.subset_vocab:
            idx_B, q_BxK = pick(key, logits_BxK, sampling)
            return params["vocab_ids"][idx_B], q_BxK
        logits_BxV = logits_BxK
        V = logits_BxV.shape[-1]
        if V > vocab_size:  # padded head: ids past the target's vocabulary are never drafted
            logits_BxV = logits_BxV[:, :vocab_size]
        elif V < vocab_size:
            logits_BxV = jnp.pad(logits_BxV, ((0, 0), (0, vocab_size - V)),
                                 constant_values=-jnp.inf)
        return pick(key, logits_BxV, sampling)

    def propose(self, params, cache, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
                features_BxTxD=None):
        B = tokens_BxT.shape[0]
        rows = jnp.arange(B)
        # Feed the last two tokens: the one before last may be missing from the cache when
        # every draft of the previous step was accepted.
        pos_Bx2 = jnp.stack([jnp.maximum(lengths_B - 2, 0), lengths_B - 1], axis=1)
        toks_Bx2 = tokens_BxT[rows[:, None], pos_Bx2]
        logits_Bx2xK, cache = forward(params["model"], self.config, toks_Bx2, pos_Bx2, cache,
                                      self.layers)
        keys = jax.random.split(key, gamma)
        tok_B, q_BxK = self._pick(params, keys[0], logits_Bx2xK[:, -1], sampling, vocab_size)

        def step(carry, xs):
            tok_B, cache = carry
            i, k = xs
            pos_Bx1 = (lengths_B + i)[:, None]
            logits_Bx1xK, cache = forward(params["model"], self.config, tok_B[:, None], pos_Bx1,
                                          cache, self.layers)
            nxt_B, q_nxt_BxK = self._pick(params, k, logits_Bx1xK[:, 0], sampling, vocab_size)
            return (nxt_B, cache), (nxt_B, q_nxt_BxK)

        # R = gamma - 1: the drafts after the first.
        (_, cache), (rest_RxB, rest_q_RxBxK) = jax.lax.scan(
            step, (tok_B, cache), (jnp.arange(gamma - 1), keys[1:]))
        draft_BxG = jnp.concatenate([tok_B[:, None], rest_RxB.T], axis=1)
        if q_BxK is None:
            return draft_BxG, None, cache
        q_BxGxK = jnp.concatenate([q_BxK[:, None], jnp.swapaxes(rest_q_RxBxK, 0, 1)], axis=1)
        ids_BxGxK = (jnp.broadcast_to(params["vocab_ids"], q_BxGxK.shape) if self.subset_vocab
                     else None)
        return draft_BxG, DraftProbs(q_BxGxK, ids_BxGxK), cache


@dataclasses.dataclass(frozen=True)
class NgramSpec:
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens (n from
    max_ngram down to 1) and propose what followed it. The proposal is deterministic, so q is
    one-hot on it."""

    max_ngram: int = 3

    def validate(self, params, target) -> None:
        """Nothing to check: the drafts are tokens of the text itself."""

    def init(self, params, tokens_BxT, lengths_B, features_BxTxD=None):
        return ()

    def propose(self, params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
                features_BxTxD=None):
        B, T = tokens_BxT.shape
        j_T = jnp.arange(T)
        best_B = jnp.full((B,), -1)
        for n in range(self.max_ngram, 0, -1):
            match_BxT = jnp.ones((B, T), bool)
            for k in range(n):
                suffix_B = jnp.take_along_axis(
                    tokens_BxT, jnp.maximum(lengths_B - n + k, 0)[:, None], axis=1)
                shifted = jnp.roll(tokens_BxT, -k, axis=1)  # shifted[j] = tokens[j + k]
                match_BxT &= shifted == suffix_B
            # The match must end before the suffix starts, and the suffix must exist.
            match_BxT &= (j_T < lengths_B[:, None] - n) & (lengths_B[:, None] > n)
            latest_B = jnp.max(jnp.where(match_BxT, j_T, -1), axis=1)
            found = (best_B < 0) & (latest_B >= 0)
            best_B = jnp.where(found, latest_B + n, best_B)
        # Continuation slots; with no match, repeat the last token.
        src_BxG = best_B[:, None] + jnp.arange(gamma)
        src_BxG = jnp.where(best_B[:, None] >= 0,
                            jnp.minimum(src_BxG, lengths_B[:, None] - 1),
                            (lengths_B - 1)[:, None])
        draft_BxG = jnp.take_along_axis(tokens_BxT, src_BxG, axis=1)
        q = None if sampling.greedy else DraftProbs(jnp.ones((B, gamma, 1)), draft_BxG[..., None])
        return draft_BxG, q, state


def model_drafter(model, vocab_ids=None) -> Drafter:
    """A separate jaxspec model as drafter; `vocab_ids` [head_vocab] when its head is a subset
    (`loading.load_drafter` reads them from a saved drafter)."""
    subset = model.config.head_vocab_size is not None
    if subset != (vocab_ids is not None):
        raise UserError("a drafter with a reduced head needs vocab_ids (head index -> token id; "
                        "jaxspec.load_drafter reads them from its checkpoint), and only such a "
                        "drafter takes them")
    params = {"model": model.params}
    if subset:
        vocab_ids = np.asarray(vocab_ids, np.int32)
        if vocab_ids.shape != (model.config.head_vocab_size,):
            raise UserError(f"vocab_ids has shape {vocab_ids.shape}, head has "
                            f"{model.config.head_vocab_size} entries")
        params["vocab_ids"] = jnp.asarray(vocab_ids)
    return Drafter(params, ModelSpec(model.config, None, subset), model.name or "model")


def layer_skip_drafter(model, skip_layers) -> Drafter:
    """Self-speculative drafting (Draft & Verify, Zhang et al. 2023): the target itself with a
    static set of layers skipped, sharing the target's params."""
    skip = set(int(i) for i in skip_layers)
    n = model.config.num_layers
    if any(not 0 <= i < n for i in skip):
        raise UserError(f"skip_layers {sorted(skip)} out of range for {n} layers")
    keep = tuple(i for i in range(n) if i not in skip)
    if not keep:
        raise UserError("layer_skip_drafter would skip every layer")
    return Drafter({"model": model.params}, ModelSpec(model.config, keep),
                   f"layer-skip({len(skip)}/{n})")


def ngram_drafter(max_ngram: int = 3) -> Drafter:
    """Prompt lookup drafting over the prompt and the text generated so far."""
    if max_ngram < 1:
        raise UserError(f"max_ngram must be >= 1, got {max_ngram}")
    return Drafter({}, NgramSpec(max_ngram), f"ngram({max_ngram})")


def as_drafter(x) -> Drafter:
    if isinstance(x, Drafter):
        return x
    if hasattr(x, "config") and hasattr(x, "params"):
        return model_drafter(x)
    raise TypeError(f"cannot draft with {type(x).__name__}: pass a jaxspec Model or a Drafter")
