"""Drafters: propose `gamma` tokens and the distribution each was drawn from.

A `Drafter` pairs a static, hashable `spec` (how to draft) with a `params` pytree (what it drafts
with). Every spec is a `DraftSpec`: it implements

    validate(params, target) -> None                    # raises UserError if it cannot serve
    init(params, tokens_BxT, lengths_B, features_BxTxD) -> state      # prefill; a pytree
    propose(params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
            features_BxTxD) -> draft_BxG, q (a DraftProbs; None when greedy), state

and `DraftSpec` declares every optional ability with its default, so the loop asks, never
probes: which rows have a draft worth verifying (`has_draft`; gamma "auto" gives the others a
plain step), token trees (`drafts_trees`, `propose_tree`: per node what it was drawn from; a
chain goes through `propose`) and EAGLE-2's dynamic ones (`drafts_dynamic_trees`), a shape of
its own (`fixed_shape`, `extend`: hybrid.py, lookahead.py), what it learns from the target's
verification (`observe`: lookahead.py), whether it reads the target's features
(`reads_features`), which drafters cost alike (`cost_key`), and the shape it was tuned for
(`tuned_gamma`, `tuned_tree`).

`tokens_BxT` holds each row's text so far in its first `lengths_B` slots. A drafter's cache must
hold positions [0, length - 2) on entry; on exit it may hold more, since the caller rolls back by
lowering lengths. A spec that reads features gets the target's hidden states for positions
[0, length - 1) in `features_BxTxD` (hidden.py); the others get [B, T, 0]. The verifier never
looks inside the drafter.
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
from jaxspec.decoding.trees import grow
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import fill_cache, forward


@flax.struct.dataclass
class Drafter:
    """A pytree: `params` are traced, `spec` is static; `name` and `tuned_accept` (the
    per-position acceptance a trained drafter recorded when it was tuned, gamma="auto"'s
    starting point) are for the host: the decode loop gets the drafter `bare`, so drafters of
    one spec and param shapes share a compiled loop."""

    params: Any
    spec: Any = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False, default="")
    tuned_accept: tuple[float, ...] | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def bare(self) -> "Drafter":
        return Drafter(self.params, self.spec)


class DraftSpec:
    """The drafter interface (module docstring): the required methods, and every optional
    ability with its default."""

    reads_features = False  # gets the target's hidden states
    drafts_trees = False  # implements propose_tree
    drafts_dynamic_trees = False  # implements propose_dynamic (EAGLE-2)
    fixed_shape = False  # `extend` gives the tree it drafts; gamma "auto" is refused
    cost_key = None  # drafters with one key share measured step costs (default: their name)
    tuned_gamma = None  # the draft length it was tuned for
    tuned_tree = None  # the token tree it was tuned for (choices)

    def validate(self, params, target) -> None:
        raise NotImplementedError

    def init(self, params, tokens_BxT, lengths_B, features_BxTxD=None):
        raise NotImplementedError

    def propose(self, params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
                features_BxTxD=None):
        raise NotImplementedError

    def propose_tree(self, params, state, tokens_BxT, lengths_B, key, sampling, tree, vocab_size,
                     features_BxTxD=None):
        raise UserError(f"drafter {type(self).__name__} cannot draft trees; use a chain (gamma)")

    def has_draft(self, params, state, tokens_BxT, lengths_B):
        """Which rows have a draft worth verifying: all of them."""
        return jnp.ones(tokens_BxT.shape[:1], bool)

    def extend(self, tree):
        """The tree the target verifies when `tree` is asked for: `tree` itself."""
        return tree

    def observe(self, params, state, logits_BxN1xV):
        """The drafter state after the target scored the root and every node: unchanged."""
        return state


@dataclasses.dataclass(frozen=True)
class ModelSpec(DraftSpec):
    """A transformer drafter: a separate model, the target with layers skipped, or a model whose
    head covers a subset of the vocabulary (params["vocab_ids"] maps head index -> token id)."""

    config: ModelConfig
    layers: tuple[int, ...] | None = None
    subset_vocab: bool = False
    drafts_trees = True

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

    def propose_tree(self, params, cache, tokens_BxT, lengths_B, key, sampling, tree, vocab_size,
                     features_BxTxD=None):
        """Top-k per node (`trees.grow`): refeed the last D + 1 tokens (after a tree step up to
        that many may be missing from the cache, whose accepted nodes sit in scratch slots),
        then one call per depth over its nodes that have children, in scratch slots past
        length - 1 with tree attention, as the target verifies them."""
        D = tree.max_depth
        base_B = lengths_B - 1
        pos_BxW = jnp.maximum(base_B[:, None] - D + jnp.arange(D + 1), 0)
        toks_BxW = jnp.take_along_axis(tokens_BxT, pos_BxW, axis=1)
        logits_BxWxK, cache = forward(params["model"], self.config, toks_BxW, pos_BxW, cache,
                                      self.layers)

        def expand(d, nodes, tok_BxP, cache):
            pos_BxP = jnp.broadcast_to((base_B + d)[:, None], tok_BxP.shape)
            logits_BxPxK, cache = forward(
                params["model"], self.config, tok_BxP, pos_BxP, cache, self.layers,
                slots_BxS=base_B[:, None] + 1 + nodes, tree=tree.region(base_B, nodes))
            return self._vocab_logits(logits_BxPxK, vocab_size), cache

        return grow(tree, key, sampling, self._vocab_logits(logits_BxWxK[:, -1], vocab_size),
                    expand, cache, params["vocab_ids"] if self.subset_vocab else None)


@dataclasses.dataclass(frozen=True)
class NgramSpec(DraftSpec):
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens (n from
    max_ngram down to 1) and propose what followed it. The proposal is deterministic, so q is
    one-hot on it."""

    max_ngram: int = 3
    drafts_trees = True

    def validate(self, params, target) -> None:
        """Nothing to check: the drafts are tokens of the text itself."""

    def init(self, params, tokens_BxT, lengths_B, features_BxTxD=None):
        return ()

    def has_draft(self, params, state, tokens_BxT, lengths_B):
        """Whether each row's last tokens occurred before (without a match the draft repeats
        the last token, which gamma "auto" does not verify)."""
        return self._continuation(tokens_BxT, lengths_B) >= 0

    def _continuation(self, tokens_BxT, lengths_B):
        """The slot after the latest earlier occurrence of each row's longest matching suffix
        (n = max_ngram down to 1), or -1."""
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
        return best_B

    def propose(self, params, state, tokens_BxT, lengths_B, key, sampling, gamma, vocab_size,
                features_BxTxD=None):
        B = tokens_BxT.shape[0]
        best_B = self._continuation(tokens_BxT, lengths_B)
        # Continuation slots; with no match, repeat the last token.
        src_BxG = best_B[:, None] + jnp.arange(gamma)
        src_BxG = jnp.where(best_B[:, None] >= 0,
                            jnp.minimum(src_BxG, lengths_B[:, None] - 1),
                            (lengths_B - 1)[:, None])
        draft_BxG = jnp.take_along_axis(tokens_BxT, src_BxG, axis=1)
        q = None if sampling.greedy else DraftProbs(jnp.ones((B, gamma, 1)), draft_BxG[..., None])
        return draft_BxG, q, state

    def propose_tree(self, params, state, tokens_BxT, lengths_B, key, sampling, tree, vocab_size,
                     features_BxTxD=None):
        """A node's children, by rank: the distinct tokens that followed the latest earlier
        occurrences of the last n tokens of the text extended by the node's path (n from
        max_ngram down to 1, the longest first, then the most recent); missing ones repeat the
        node's own token. The drafts are deterministic, so q is one-hot."""
        B, M = tokens_BxT.shape[0], self.max_ngram
        pos_BxM = lengths_B[:, None] - M + jnp.arange(M)
        tails = {0: jnp.take_along_axis(tokens_BxT, jnp.maximum(pos_BxM, 0), axis=1)}
        draft = [None] * tree.size
        for i in range(tree.size):  # parents come first
            f, d = int(tree.parent_N[i]), int(tree.depth_N1[i + 1])
            if f not in tails:
                tail_BxM = tails[int(tree.parent_N[f - 1])]
                tails[f] = jnp.concatenate([tail_BxM[:, 1:], draft[f - 1][:, None]], axis=1)
            kids = tree.children_N1xW[f]
            if i == kids[0]:  # the first child: find candidates for all of them
                cands_BxR = self._candidates(tokens_BxT, lengths_B, tails[f], lengths_B + d - 1,
                                             int(tree.rank_N[kids[kids >= 0]].max()) + 1)
            draft[i] = cands_BxR[:, tree.rank_N[i]]
        draft_BxN = jnp.stack(draft, axis=1)
        q = None if sampling.greedy else DraftProbs(jnp.ones((B, tree.size, 1)),
                                                    draft_BxN[..., None])
        return draft_BxN, q, state

    def _candidates(self, tokens_BxT, lengths_B, tail_BxM, context_B, R: int):
        """Up to R distinct next tokens [B, R] after the context ending in `tail_BxM` (its last
        max_ngram tokens; the context has `context_B` tokens), by match length then recency."""
        B, T = tokens_BxT.shape
        M, C = self.max_ngram, min(T, R + 2)  # C latest matches per n cover R distinct tokens
        j_T, rows_B = jnp.arange(T), jnp.arange(B)
        cands, ok = [], []
        for n in range(M, 0, -1):
            match_BxT = (j_T < lengths_B[:, None] - n) & (context_B[:, None] >= n)
            for k in range(n):
                match_BxT &= jnp.roll(tokens_BxT, -k, axis=1) == tail_BxM[:, M - n + k, None]
            latest_BxC = jax.lax.top_k(jnp.where(match_BxT, j_T, -1), C)[0]
            cands.append(jnp.take_along_axis(tokens_BxT, jnp.maximum(latest_BxC + n, 0), axis=1))
            ok.append(latest_BxC >= 0)
        cands_BxK, ok_BxK = jnp.concatenate(cands, axis=1), jnp.concatenate(ok, axis=1)
        out_BxR, count_B = jnp.full((B, R), -1), jnp.zeros((B,), jnp.int32)
        for c in range(cands_BxK.shape[1]):
            tok_B = cands_BxK[:, c]
            new_B = ok_BxK[:, c] & ~jnp.any(out_BxR == tok_B[:, None], axis=1) & (count_B < R)
            out_BxR = out_BxR.at[rows_B, jnp.where(new_B, count_B, R)].set(tok_B, mode="drop")
            count_B += new_B
        return jnp.where(out_BxR < 0, tail_BxM[:, -1:], out_BxR)


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
