"""Prompt lookup: the text's own continuations of its last tokens as drafts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import DraftProbs
from jaxspec.drafters.base import Draft, Drafter, DraftInput, DraftSpec
from jaxspec.errors import UserError


@dataclasses.dataclass(frozen=True)
class NgramSpec(DraftSpec):
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens (n from
    max_ngram down to 1) and propose what followed it. The proposal is deterministic, so q is
    one-hot on it."""

    max_ngram: int = 3
    drafts_trees = True

    def validate(self, params, target) -> None:
        """Nothing to check: the drafts are tokens of the text itself."""

    def init(self, params, inp: DraftInput):
        return ()

    def has_draft(self, params, state, inp: DraftInput):
        """Whether each row's last tokens occurred before (without a match the draft repeats
        the last token, which gamma "auto" does not verify)."""
        return self._continuation(inp.tokens_BxT, inp.lengths_B) >= 0

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

    def draft_chain(self, params, state, inp: DraftInput, key, sampling, gamma: int) -> Draft:
        tokens_BxT, lengths_B = inp.tokens_BxT, inp.lengths_B
        B = tokens_BxT.shape[0]
        best_B = self._continuation(tokens_BxT, lengths_B)
        # Continuation slots; with no match, repeat the last token.
        src_BxG = best_B[:, None] + jnp.arange(gamma)
        src_BxG = jnp.where(best_B[:, None] >= 0,
                            jnp.minimum(src_BxG, lengths_B[:, None] - 1),
                            (lengths_B - 1)[:, None])
        draft_BxG = jnp.take_along_axis(tokens_BxT, src_BxG, axis=1)
        q = None if sampling.greedy else DraftProbs(jnp.ones((B, gamma, 1)), draft_BxG[..., None])
        return Draft(draft_BxG, q, state)

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree) -> Draft:
        """A node's children, by rank: the distinct tokens that followed the latest earlier
        occurrences of the last n tokens of the text extended by the node's path (n from
        max_ngram down to 1, the longest first, then the most recent); missing ones repeat the
        node's own token. The drafts are deterministic, so q is one-hot."""
        tokens_BxT, lengths_B = inp.tokens_BxT, inp.lengths_B
        B, L = tokens_BxT.shape[0], self.max_ngram
        pos_BxL = lengths_B[:, None] - L + jnp.arange(L)
        tails = {0: jnp.take_along_axis(tokens_BxT, jnp.maximum(pos_BxL, 0), axis=1)}
        draft = [None] * tree.size
        for i in range(tree.size):  # parents come first
            f, d = int(tree.parent_N[i]), int(tree.depth_N1[i + 1])
            if f not in tails:
                tail_BxL = tails[int(tree.parent_N[f - 1])]
                tails[f] = jnp.concatenate([tail_BxL[:, 1:], draft[f - 1][:, None]], axis=1)
            kids = tree.children_N1xW[f]
            if i == kids[0]:  # the first child: find candidates for all of them
                cands_BxW = self._candidates(tokens_BxT, lengths_B, tails[f], lengths_B + d - 1,
                                             int(tree.rank_N[kids[kids >= 0]].max()) + 1)
            draft[i] = cands_BxW[:, tree.rank_N[i]]
        draft_BxN = jnp.stack(draft, axis=1)
        q = None if sampling.greedy else DraftProbs(jnp.ones((B, tree.size, 1)),
                                                    draft_BxN[..., None])
        return Draft(draft_BxN, q, state)

    def _candidates(self, tokens_BxT, lengths_B, tail_BxL, context_B, W: int):
        """Up to W distinct next tokens [B, W] after the context ending in `tail_BxL` (its last
        max_ngram tokens; the context has `context_B` tokens), by match length then recency."""
        B, T = tokens_BxT.shape
        L, X = self.max_ngram, min(T, W + 2)  # X latest matches per n cover W distinct tokens
        j_T, rows_B = jnp.arange(T), jnp.arange(B)
        cands, ok = [], []
        for n in range(L, 0, -1):
            match_BxT = (j_T < lengths_B[:, None] - n) & (context_B[:, None] >= n)
            for k in range(n):
                match_BxT &= jnp.roll(tokens_BxT, -k, axis=1) == tail_BxL[:, L - n + k, None]
            latest_BxX = jax.lax.top_k(jnp.where(match_BxT, j_T, -1), X)[0]
            cands.append(jnp.take_along_axis(tokens_BxT, jnp.maximum(latest_BxX + n, 0), axis=1))
            ok.append(latest_BxX >= 0)
        cands_BxX, ok_BxX = jnp.concatenate(cands, axis=1), jnp.concatenate(ok, axis=1)
        out_BxW, count_B = jnp.full((B, W), -1), jnp.zeros((B,), jnp.int32)
        for c in range(cands_BxX.shape[1]):
            tok_B = cands_BxX[:, c]
            new_B = ok_BxX[:, c] & ~jnp.any(out_BxW == tok_B[:, None], axis=1) & (count_B < W)
            out_BxW = out_BxW.at[rows_B, jnp.where(new_B, count_B, W)].set(tok_B, mode="drop")
            count_B += new_B
        return jnp.where(out_BxW < 0, tail_BxL[:, -1:], out_BxW)


def ngram_drafter(max_ngram: int = 3) -> Drafter:
    """Prompt lookup drafting over the prompt and the text generated so far."""
    if max_ngram < 1:
        raise UserError(f"max_ngram must be >= 1, got {max_ngram}")
    return Drafter({}, NgramSpec(max_ngram), f"ngram({max_ngram})")
