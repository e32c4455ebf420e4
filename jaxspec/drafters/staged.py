"""Staged drafting (Spector & Ré 2023, "Staged Speculative Decoding"): a transformer drafter whose
own drafting is sped up by n-gram lookup.

Each round, n-gram lookup proposes k tokens after the draft so far; the drafter scores the last
two tokens and all k proposals in one call and keeps the proposals it agrees with, up to the
first it refuses, plus one token of its own. Greedy, it agrees when a proposal is its argmax;
sampling, it keeps a proposal x with probability q(x) and otherwise draws from q without x, so
each draft is distributed as q. Either way the drafts and their q are the drafter's own (up to
the rounding of scoring several positions in one call), and the drafter runs once per round
instead of once per token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import DraftProbs, argmax, probs, sample
from jaxspec.drafters.base import Draft, Drafter, DraftInput, DraftSpec
from jaxspec.drafters.model import ModelSpec
from jaxspec.drafters.ngram import NgramSpec, ngram_drafter
from jaxspec.errors import UserError
from jaxspec.models.transformer import forward


@dataclasses.dataclass(frozen=True)
class StagedSpec(DraftSpec):
    first: ModelSpec
    second: NgramSpec
    k: int = 3

    def validate(self, params, target) -> None:
        self.first.validate(params["first"], target)

    def init(self, params, inp: DraftInput):
        return self.first.init(params["first"], inp)

    def _dist(self, params, logits_BxWxK, sampling, vocab_size):
        """Greedy: the drafter's token at each position [B, W]; sampling: q [B, W, K]."""
        logits = self.first._vocab_logits(logits_BxWxK, vocab_size)
        if sampling.greedy:
            idx_BxW = argmax(logits)
            return params["vocab_ids"][idx_BxW] if self.first.subset_vocab else idx_BxW
        return probs(logits, sampling)

    def draft_chain(self, params, cache, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        tokens_BxT, lengths_B, vocab_size = inp.tokens_BxT, inp.lengths_B, inp.vocab_size
        B, T = tokens_BxT.shape
        k, W = self.k, self.k + 2
        rows_B = jnp.arange(B)
        fp = params["first"]
        ids_K = fp["vocab_ids"] if self.first.subset_vocab else None

        def round_(carry):
            text_BxT, n_B, draft_BxG, q, cache, key = carry
            key, k_prop, k_keep, k_draw = jax.random.split(key, 4)
            c_B = lengths_B + n_B  # the text so far: prompt, accepted tokens, drafts
            prop_BxK = self.second.draft_chain(params["second"], (), inp.replace(
                tokens_BxT=text_BxT, lengths_B=c_B), k_prop, sampling, k).tokens_BxN
            # Refeed the last two tokens (the drafter's own last token was never fed), then
            # the proposals; positions past the cache are not written and their logits unused.
            pos_BxW = c_B[:, None] - 2 + jnp.arange(W)
            prev_Bx2 = text_BxT[rows_B[:, None], jnp.maximum(pos_BxW[:, :2], 0)]
            toks_BxW = jnp.concatenate([prev_Bx2, prop_BxK], axis=1)
            logits_BxWxK, cache = forward(fp["model"], self.first.config, toks_BxW,
                                          jnp.maximum(pos_BxW, 0), cache, self.first.layers)
            dist = self._dist(fp, logits_BxWxK[:, 1:], sampling, vocab_size)  # [B, k + 1, ...]
            if sampling.greedy:
                own_BxJ = dist  # J = k + 1: the drafter's token after each proposal prefix
                kept_BxK = own_BxJ[:, :k] == prop_BxK
                out_BxJ, q_BxJxK = own_BxJ, None
            else:
                q_BxJxK = dist
                q_BxKxK = q_BxJxK[:, :k]
                q_prop_BxK = DraftProbs(q_BxKxK, None if ids_K is None else
                                        jnp.broadcast_to(ids_K, q_BxKxK.shape)).of(prop_BxK)
                kept_BxK = jax.random.uniform(k_keep, (B, k)) < q_prop_BxK
                off_BxJxK = jnp.concatenate(  # q without the proposal, for refused positions
                    [_without(q_BxJxK[:, :k], prop_BxK, ids_K), q_BxJxK[:, k:]], axis=1)
                idx_BxJ = sample(k_draw, off_BxJxK)
                own_BxJ = ids_K[idx_BxJ] if ids_K is not None else idx_BxJ
                prop_BxJ = jnp.pad(prop_BxK, ((0, 0), (0, 1)))
                kept_BxJ = jnp.pad(kept_BxK, ((0, 0), (0, 1)))
                out_BxJ = jnp.where(kept_BxJ, prop_BxJ, own_BxJ)
            m_B = jnp.argmin(jnp.pad(kept_BxK, ((0, 0), (0, 1))), axis=1)  # proposals kept
            gain_B = jnp.minimum(m_B + 1, gamma - n_B)
            j_BxJ = jnp.arange(k + 1)[None, :]
            live_BxJ = j_BxJ < gain_B[:, None]
            at_BxJ = jnp.where(live_BxJ, n_B[:, None] + j_BxJ, gamma)  # gamma: dropped
            draft_BxG = draft_BxG.at[rows_B[:, None], at_BxJ].set(out_BxJ, mode="drop")
            text_BxT = text_BxT.at[rows_B[:, None], jnp.where(live_BxJ, c_B[:, None] + j_BxJ, T)
                                   ].set(out_BxJ, mode="drop")
            if q is not None:
                q = q.at[rows_B[:, None], at_BxJ].set(q_BxJxK, mode="drop")
            return text_BxT, n_B + gain_B, draft_BxG, q, cache, key

        K = ids_K.shape[0] if ids_K is not None else vocab_size
        q0 = None if sampling.greedy else jnp.zeros((B, gamma, K), jnp.float32)
        carry = (tokens_BxT, jnp.zeros(B, jnp.int32), jnp.zeros((B, gamma), jnp.int32), q0,
                 cache, key)
        _, _, draft_BxG, q, cache, _ = jax.lax.while_loop(
            lambda c: jnp.any(c[1] < gamma), round_, carry)
        if q is None:
            return Draft(draft_BxG, None, cache)
        ids = None if ids_K is None else jnp.broadcast_to(ids_K, q.shape)
        return Draft(draft_BxG, DraftProbs(q, ids), cache)


def _without(q_BxJxK, tok_BxJ, ids_K):
    """q with each token's mass removed (unnormalised: `sample` takes any mass)."""
    if ids_K is None:
        hit = jnp.arange(q_BxJxK.shape[-1]) == tok_BxJ[..., None]
    else:
        hit = ids_K == tok_BxJ[..., None]
    return jnp.where(hit, 0.0, q_BxJxK)


def staged_drafter(drafter: Drafter, second: Drafter | None = None, k: int = 3) -> Drafter:
    """`drafter` (a model or layer-skip drafter) drafting its own tokens faster with `second`
    (n-gram lookup, `ngram_drafter(3)` by default) proposing `k` tokens a round; the drafts are
    exactly `drafter`'s."""
    second = second or ngram_drafter(3)
    if not isinstance(drafter.spec, ModelSpec):
        raise UserError(f"staged drafting speeds up a transformer drafter (a model or layer "
                        f"skip), not {type(drafter.spec).__name__}")
    if not isinstance(second.spec, NgramSpec):
        raise UserError(f"the second stage must be n-gram lookup, not {type(second.spec).__name__}")
    if k < 1:
        raise UserError(f"the second stage must propose k >= 1 tokens, got {k}")
    return Drafter({"first": drafter.params, "second": second.params},
                   StagedSpec(drafter.spec, second.spec, int(k)),
                   f"{drafter.name}+{second.name}x{k}")
