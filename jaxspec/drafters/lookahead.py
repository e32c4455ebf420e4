"""Lookahead decoding (Fu et al. 2024): the target drafts for itself by Jacobi iteration.

Each row keeps a window of guesses, `ngram` - 1 levels of `window` tokens, and a pool of n-grams.
Every step the target scores, in the same call that verifies the drafts, the window laid out as
a token tree under the row's last token: level 0 is a chain (column i at depth i + 1) and each
column's higher levels hang under it (level l of column i at depth i + l + 1), so a guess sees
exactly the guesses before it in its own trajectory. The target's greedy token after each
column's top level is that column's next guess (one Jacobi iteration); the column's trajectory
and it form an n-gram for the pool, and the levels move down by one. Beside the window, up to
`candidates` pooled n-grams that begin with the row's last token are verified as branches of the
same tree. Lookahead, branches and all are drafts like any other: greedy acceptance keeps the
deepest accepted node and sampling the sibling rule with their one-hot q, so the output is
exactly the target's. The guesses' target tokens reach the drafter through `observe`, the one
step the loop gives a drafter after verification.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.sampling import DraftProbs, argmax
from jaxspec.decoding.trees import Tree
from jaxspec.drafters.base import Draft, Drafter, DraftInput, DraftSpec
from jaxspec.errors import UserError


@dataclasses.dataclass(frozen=True)
class LookaheadSpec(DraftSpec):
    window: int = 5  # W: guesses per level
    ngram: int = 4  # N: n-gram length; the window keeps N - 1 levels
    candidates: int = 5  # G: pooled n-grams verified per step
    pool: int = 64  # n-grams kept per row, the oldest replaced first
    drafts_trees = True
    fixed_shape = True

    def validate(self, params, target) -> None:
        """Nothing to check: every guess is a token of the target's vocabulary."""

    @functools.cached_property
    def tree(self) -> Tree:
        """The window's nodes, then the candidates' (`_paths`), sorted as `Tree` numbers them."""
        return Tree(tuple(sorted(self._paths(), key=lambda p: (len(p), p))))

    @property
    def tuned_tree(self) -> Tree:
        return self.tree

    def extend(self, tree: Tree) -> Tree:
        """The tree the target verifies: Lookahead's own; any other shape is refused."""
        if tree != self.tree:
            raise UserError("lookahead decoding verifies its own tree (window, ngram, "
                            "candidates): give it neither gamma nor tree")
        return tree

    @staticmethod
    def _window_path(column: int, level: int) -> tuple[int, ...]:
        """Rank-0 steps down level 0 to the column, then a rank-1 step and rank-0 steps up it."""
        return (0,) * (column + 1) + ((1,) + (0,) * (level - 1) if level else ())

    def _paths(self):
        """The window's columns level by level; candidate g: rank g + 1 under the root, then
        rank-0 steps."""
        W, L = self.window, self.ngram - 1
        for i in range(W):
            for lv in range(L):
                yield self._window_path(i, lv)
        for g in range(self.candidates):
            for d in range(L):
                yield (g + 1,) + (0,) * d

    @functools.cached_property
    def _nodes(self):
        """Node indices of window[level, column] [L, W] and of candidate g's token d [G, L]."""
        index = {p: n for n, p in enumerate(self.tree.paths)}
        W, L, G = self.window, self.ngram - 1, self.candidates
        win = [[index[self._window_path(i, lv)] for i in range(W)] for lv in range(L)]
        cand = [[index[(g + 1,) + (0,) * d] for d in range(L)] for g in range(G)]
        return np.asarray(win, np.int32), np.asarray(cand, np.int32).reshape(G, L)

    def init(self, params, inp: DraftInput):
        """Level l, column i starts as the prompt's token l + i + 1 places before its end (any
        guess is exact; Jacobi iteration replaces them); the pool starts empty."""
        tokens_BxT, lengths_B = inp.tokens_BxT, inp.lengths_B
        B, L, W = tokens_BxT.shape[0], self.ngram - 1, self.window
        back_LxW = jnp.arange(L)[:, None] + jnp.arange(W)[None, :] + 1
        slots_BxLxW = jnp.maximum(lengths_B[:, None, None] - back_LxW, 0)
        window_BxLxW = jnp.take_along_axis(tokens_BxT, slots_BxLxW.reshape(B, -1), axis=1)
        return dict(window_BxLxW=window_BxLxW.reshape(B, L, W),
                    pool_BxPxL1=jnp.full((B, self.pool, self.ngram), -1, jnp.int32),
                    age_BxP=jnp.full((B, self.pool), -1, jnp.int32),
                    steps_B=jnp.zeros((B,), jnp.int32))

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree) -> Draft:
        """The window's guesses, and the newest pooled n-grams that begin with the row's last
        token (a missing one repeats that token); q is one-hot."""
        tokens_BxT, lengths_B = inp.tokens_BxT, inp.lengths_B
        B, G = tokens_BxT.shape[0], self.candidates
        win_LxW, cand_GxL = self._nodes
        last_B = jnp.take_along_axis(tokens_BxT, (lengths_B - 1)[:, None], axis=1)[:, 0]
        pool_BxPxL1, age_BxP = state["pool_BxPxL1"], state["age_BxP"]
        match_BxP = (pool_BxPxL1[..., 0] == last_B[:, None]) & (age_BxP >= 0)
        age_BxG, pick_BxG = jax.lax.top_k(jnp.where(match_BxP, age_BxP, -1), G)
        grams_BxGxL1 = jnp.take_along_axis(pool_BxPxL1, pick_BxG[..., None], axis=1)
        grams_BxGxL = jnp.where(age_BxG[..., None] >= 0, grams_BxGxL1[..., 1:],
                                last_B[:, None, None])
        draft_BxN = jnp.zeros((B, tree.size), jnp.int32)
        draft_BxN = draft_BxN.at[:, win_LxW.reshape(-1)].set(
            state["window_BxLxW"].reshape(B, -1))
        draft_BxN = draft_BxN.at[:, cand_GxL.reshape(-1)].set(grams_BxGxL.reshape(B, -1))
        q = None if sampling.greedy else DraftProbs(jnp.ones((B, tree.size, 1)),
                                                    draft_BxN[..., None])
        return Draft(draft_BxN, q, state)

    def observe(self, params, state, logits_BxN1xV):
        """One Jacobi iteration from the target's logits at the root and every node: each
        column's next guess is the target's token after its top level; once the levels hold a
        full trajectory, each column's n-gram joins the pool (unless it is there already)."""
        win_LxW, _ = self._nodes
        B, L, W = state["window_BxLxW"].shape
        top_BxWxV = jnp.take(logits_BxN1xV, win_LxW[-1] + 1, axis=1)  # feed index = node + 1
        next_BxW = argmax(top_BxWxV)
        window_BxLxW = state["window_BxLxW"]
        grams_BxWxL1 = jnp.concatenate([jnp.swapaxes(window_BxLxW, 1, 2), next_BxW[..., None]],
                                      axis=2)
        pool_BxPxL1, age_BxP, steps_B = state["pool_BxPxL1"], state["age_BxP"], state["steps_B"]
        full_B = steps_B >= L - 1  # every level was written by an iteration
        rows_B = jnp.arange(B)
        for i in range(W):
            gram_BxL1 = grams_BxWxL1[:, i]
            known_B = jnp.any(jnp.all(pool_BxPxL1 == gram_BxL1[:, None], axis=2) & (age_BxP >= 0),
                              axis=1)
            slot_B = jnp.argmin(age_BxP, axis=1)  # empty (-1) or the oldest
            put_B = full_B & ~known_B
            stamp_B = steps_B * W + i
            pool_BxPxL1 = pool_BxPxL1.at[rows_B, slot_B].set(
                jnp.where(put_B[:, None], gram_BxL1, pool_BxPxL1[rows_B, slot_B]))
            age_BxP = age_BxP.at[rows_B, slot_B].set(
                jnp.where(put_B, stamp_B, age_BxP[rows_B, slot_B]))
        window_BxLxW = jnp.concatenate([window_BxLxW[:, 1:], next_BxW[:, None]], axis=1)
        return dict(window_BxLxW=window_BxLxW, pool_BxPxL1=pool_BxPxL1, age_BxP=age_BxP,
                    steps_B=steps_B + 1)


def lookahead_drafter(window: int = 5, ngram: int = 4, candidates: int = 5,
                      pool: int = 64) -> Drafter:
    """Lookahead decoding: the target's own Jacobi iterations over `window` guesses keep a pool
    of `ngram`-grams, and up to `candidates` of them are verified each step (module docstring)."""
    if window < 1 or ngram < 2 or candidates < 0 or pool < max(candidates, window):
        raise UserError(f"lookahead needs window >= 1, ngram >= 2, candidates >= 0 and a pool "
                        f"of at least max(window, candidates) n-grams; got window={window}, "
                        f"ngram={ngram}, candidates={candidates}, pool={pool}")
    return Drafter({}, LookaheadSpec(window, ngram, candidates, pool),
                   f"lookahead({window},{ngram},{candidates})")
