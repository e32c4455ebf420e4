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

    def own_params(self, params):
        return self.first.own_params(params["first"])

    def _dist(self, params, logits_BxSxK, sampling, vocab_size):
        """Greedy: the drafter's token at each position [B, S]; sampling: q [B, S, K]."""
        logits = self.first._vocab_logits(logits_BxSxK, vocab_size)
        if sampling.greedy:
            idx_BxS = argmax(logits)
            return params["vocab_ids"][idx_BxS] if self.first.subset_vocab else idx_BxS
        return probs(logits, sampling)

    def draft_chain(self, params, cache, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        tokens_BxT, lengths_B, vocab_size = inp.tokens_BxT, inp.lengths_B, inp.vocab_size
        B, T = tokens_BxT.shape
        k, S = self.k, self.k + 2
        rows_B = jnp.arange(B)
        fp = params["first"]
        ids_K = fp["vocab_ids"] if self.first.subset_vocab else None

        def round_(carry):
            text_BxT, n_B, draft_BxG, q, cache, key = carry
            key, k_prop, k_keep, k_draw = jax.random.split(key, 4)
            c_B = lengths_B + n_B  # the text so far: prompt, accepted tokens, drafts
            prop_BxX = self.second.draft_chain(params["second"], (), inp.replace(
                tokens_BxT=text_BxT, lengths_B=c_B), k_prop, sampling, k).tokens_BxN
            # Refeed the last two tokens (the drafter's own last token was never fed), then
            # the proposals; positions past the cache are not written and their logits unused.
            pos_BxS = c_B[:, None] - 2 + jnp.arange(S)
            prev_Bx2 = text_BxT[rows_B[:, None], jnp.maximum(pos_BxS[:, :2], 0)]
            toks_BxS = jnp.concatenate([prev_Bx2, prop_BxX], axis=1)
            logits_BxSxK, cache = forward(fp["model"], self.first.config, toks_BxS,
                                          jnp.maximum(pos_BxS, 0), cache, self.first.layers)
            dist = self._dist(fp, logits_BxSxK[:, 1:], sampling, vocab_size)  # [B, k + 1, ...]
            if sampling.greedy:
                own_BxX1 = dist  # X1 = k + 1: the drafter's token after each proposal prefix
                kept_BxX = own_BxX1[:, :k] == prop_BxX
                out_BxX1, q_BxX1xK = own_BxX1, None
            else:
                q_BxX1xK = dist
                q_BxXxK = q_BxX1xK[:, :k]
                q_prop_BxX = DraftProbs(q_BxXxK, None if ids_K is None else
                                        jnp.broadcast_to(ids_K, q_BxXxK.shape)).of(prop_BxX)
                kept_BxX = jax.random.uniform(k_keep, (B, k)) < q_prop_BxX
                off_BxX1xK = jnp.concatenate(  # q without the proposal, for refused positions
                    [_without(q_BxX1xK[:, :k], prop_BxX, ids_K), q_BxX1xK[:, k:]], axis=1)
                idx_BxX1 = sample(k_draw, off_BxX1xK)
                own_BxX1 = ids_K[idx_BxX1] if ids_K is not None else idx_BxX1
                prop_BxX1 = jnp.pad(prop_BxX, ((0, 0), (0, 1)))
                kept_BxX1 = jnp.pad(kept_BxX, ((0, 0), (0, 1)))
                out_BxX1 = jnp.where(kept_BxX1, prop_BxX1, own_BxX1)
            m_B = jnp.argmin(jnp.pad(kept_BxX, ((0, 0), (0, 1))), axis=1)  # proposals kept
            gain_B = jnp.minimum(m_B + 1, gamma - n_B)
            j_BxX1 = jnp.arange(k + 1)[None, :]
            live_BxX1 = j_BxX1 < gain_B[:, None]
            at_BxX1 = jnp.where(live_BxX1, n_B[:, None] + j_BxX1, gamma)  # gamma: dropped
            draft_BxG = draft_BxG.at[rows_B[:, None], at_BxX1].set(out_BxX1, mode="drop")
            text_BxT = text_BxT.at[rows_B[:, None], jnp.where(live_BxX1, c_B[:, None] + j_BxX1, T)
                                   ].set(out_BxX1, mode="drop")
            if q is not None:
                q = q.at[rows_B[:, None], at_BxX1].set(q_BxX1xK, mode="drop")
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


def _without(q_BxX1xK, tok_BxX1, ids_K):
    """q with each token's mass removed (unnormalised: `sample` takes any mass)."""
    if ids_K is None:
        hit = jnp.arange(q_BxX1xK.shape[-1]) == tok_BxX1[..., None]
    else:
        hit = ids_K == tok_BxX1[..., None]
    return jnp.where(hit, 0.0, q_BxX1xK)


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
