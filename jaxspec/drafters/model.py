"""Transformer drafters: a separate model (its head may cover a subset of the vocabulary), or the
target itself with layers skipped (Draft & Verify)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.sampling import DraftProbs, Sampling, pick
from jaxspec.decoding.trees import grow
from jaxspec.drafters.base import Draft, Drafter, DraftInput, DraftSpec
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import fill_cache, forward


@dataclasses.dataclass(frozen=True)
class ModelSpec(DraftSpec):
    """A transformer drafter: a separate model, the target with layers skipped, or a model whose
    head covers a subset of the vocabulary (params["vocab_ids"] maps head index -> token id)."""

    config: ModelConfig
    layers: tuple[int, ...] | None = None
    subset_vocab: bool = False
    vocab_prefix: bool = False  # its tokenizer was checked to be a prefix of the target's
    drafts_trees = True

    def own_params(self, params):
        """None for the target with layers skipped: its params are the target's."""
        return {} if self.layers is not None else params

    def validate(self, params, target) -> None:
        """Refuse a head whose ids would mean other tokens than the target's."""
        tv, dv = target.config.vocab_size, self.config.vocab_size
        if self.subset_vocab:
            ids = np.asarray(params["vocab_ids"])
            if ids.min() < 0 or ids.max() >= tv:
                raise UserError(f"drafter vocab_ids reach {ids.max()}, target vocabulary is {tv}")
            return
        if tv == dv or (dv < tv and self.vocab_prefix):
            return  # a prefix: it never drafts an id it lacks (`_vocab_logits`)
        # Heads that differ only by padding past the tokenizer's real vocabulary are accepted.
        real = len(target.tokenizer) if target.tokenizer is not None else None
        if real is None or min(tv, dv) < real:
            raise UserError(f"drafter vocabulary ({dv}) does not match the target's ({tv}); a "
                            f"smaller one is accepted when its tokens are the target's first "
                            f"{dv}, which takes both models' tokenizers to check")

    def init(self, params, inp: DraftInput):
        B, T = inp.tokens_BxT.shape
        n_layers = len(self.layers) if self.layers is not None else None
        cache = init_cache(self.config, B, T, num_layers=n_layers)
        return fill_cache(params["model"], self.config, inp.tokens_BxT, inp.lengths_B, cache,
                          self.layers)

    def _pick(self, params, key, logits_BxK, sampling: Sampling, vocab_size: int):
        """Draft token [B] and the distribution it was drawn from [B, K] (None when greedy): K
        is the head's vocabulary for a subset head (at params["vocab_ids"]), else the target's."""
        if self.subset_vocab:
            idx_B, q_BxK = pick(key, logits_BxK, sampling)
            return params["vocab_ids"][idx_B], q_BxK
        return pick(key, self._vocab_logits(logits_BxK, vocab_size), sampling)

    def _vocab_logits(self, logits_xK, vocab_size: int):
        """A full head's logits over the target's vocabulary (a subset head's stay as they are)."""
        V = logits_xK.shape[-1]
        if self.subset_vocab or V == vocab_size:
            return logits_xK
        if V > vocab_size:  # padded head: ids past the target's vocabulary are never drafted
            return logits_xK[..., :vocab_size]
        pad = [(0, 0)] * (logits_xK.ndim - 1) + [(0, vocab_size - V)]
        return jnp.pad(logits_xK, pad, constant_values=-jnp.inf)

    def draft_chain(self, params, cache, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        tokens_BxT, lengths_B, vocab_size = inp.tokens_BxT, inp.lengths_B, inp.vocab_size
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
        (_, cache), (rest_UxB, rest_q_UxBxK) = jax.lax.scan(
            step, (tok_B, cache), (jnp.arange(gamma - 1), keys[1:]))
        draft_BxG = jnp.concatenate([tok_B[:, None], rest_UxB.T], axis=1)
        if q_BxK is None:
            return Draft(draft_BxG, None, cache)
        q_BxGxK = jnp.concatenate([q_BxK[:, None], jnp.swapaxes(rest_q_UxBxK, 0, 1)], axis=1)
        ids_BxGxK = (jnp.broadcast_to(params["vocab_ids"], q_BxGxK.shape) if self.subset_vocab
                     else None)
        return Draft(draft_BxG, DraftProbs(q_BxGxK, ids_BxGxK), cache)

    def draft_tree(self, params, cache, inp: DraftInput, key, sampling, tree) -> Draft:
        """Top-k per node (`trees.grow`): refeed the last A + 1 tokens (after a tree step up to
        that many may be missing from the cache, whose accepted nodes sit in scratch slots),
        then one call per depth over its nodes that have children, in scratch slots past
        length - 1 with tree attention, as the target verifies them."""
        A, vocab_size = tree.max_depth, inp.vocab_size
        base_B = inp.lengths_B - 1
        pos_BxS = jnp.maximum(base_B[:, None] - A + jnp.arange(A + 1), 0)
        toks_BxS = jnp.take_along_axis(inp.tokens_BxT, pos_BxS, axis=1)
        logits_BxSxK, cache = forward(params["model"], self.config, toks_BxS, pos_BxS, cache,
                                      self.layers)

        def expand(d, nodes, tok_BxP, cache):
            pos_BxP = jnp.broadcast_to((base_B + d)[:, None], tok_BxP.shape)
            logits_BxPxK, cache = forward(
                params["model"], self.config, tok_BxP, pos_BxP, cache, self.layers,
                slots_BxS=base_B[:, None] + 1 + nodes, tree=tree.region(base_B, nodes))
            return self._vocab_logits(logits_BxPxK, vocab_size), cache

        return Draft(*grow(tree, key, sampling,
                           self._vocab_logits(logits_BxSxK[:, -1], vocab_size), expand, cache,
                           params["vocab_ids"] if self.subset_vocab else None))


def same_tokens(target_tokenizer, drafter_tokenizer) -> bool:
    """Whether every id of the drafter's tokenizer means the same token in the target's (the
    drafter's vocabulary is the target's or a prefix of it)."""
    if target_tokenizer is drafter_tokenizer:
        return True
    try:
        return _same_tokens(target_tokenizer, drafter_tokenizer)
    except TypeError:  # unhashable tokenizers: not remembered
        return _same_tokens.__wrapped__(target_tokenizer, drafter_tokenizer)


@functools.lru_cache(maxsize=8)
def _same_tokens(target_tokenizer, drafter_tokenizer) -> bool:
    n = len(drafter_tokenizer)
    ids = list(range(n))
    return n <= len(target_tokenizer) and (target_tokenizer.convert_ids_to_tokens(ids)
                                           == drafter_tokenizer.convert_ids_to_tokens(ids))


def model_drafter(model, vocab_ids=None, target=None) -> Drafter:
    """A separate jaxspec model as drafter; `vocab_ids` [head_vocab] when its head is a subset
    (`loading.load_drafter` reads them from a saved drafter). With `target`, a drafter of a
    smaller vocabulary is accepted when its tokenizer's ids are the target's first ones (Gemma
    3 270M for the vision models of 262208 ids)."""
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
    prefix = (target is not None and model.config.vocab_size < target.config.vocab_size
              and None not in (model.tokenizer, target.tokenizer)
              and same_tokens(target.tokenizer, model.tokenizer))
    return Drafter(params, ModelSpec(model.config, None, subset, prefix), model.name or "model")


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


def as_drafter(x, target=None) -> Drafter:
    if isinstance(x, Drafter):
        return x
    if hasattr(x, "config") and hasattr(x, "params"):
        return model_drafter(x, target=target)
    raise TypeError(f"cannot draft with {type(x).__name__}: pass a jaxspec Model or a Drafter")
