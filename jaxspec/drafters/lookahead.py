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
    window: int = 5  # Y: guesses per level (the window's columns)
    ngram: int = 4  # n-gram length; the window keeps A = ngram - 1 levels
    candidates: int = 5  # W: pooled n-grams verified per step (children of the root)
    pool: int = 64  # E: n-grams kept per row, the oldest replaced first
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
        Y, A = self.window, self.ngram - 1
        for i in range(Y):
            for lv in range(A):
                yield self._window_path(i, lv)
        for g in range(self.candidates):
            for d in range(A):
                yield (g + 1,) + (0,) * d

    @functools.cached_property
    def _nodes(self):
        """Node indices of window[level, column] [A, Y] and of candidate g's token d [W, A]."""
        index = {p: n for n, p in enumerate(self.tree.paths)}
        Y, A, W = self.window, self.ngram - 1, self.candidates
        win = [[index[self._window_path(i, lv)] for i in range(Y)] for lv in range(A)]
        cand = [[index[(g + 1,) + (0,) * d] for d in range(A)] for g in range(W)]
        return np.asarray(win, np.int32), np.asarray(cand, np.int32).reshape(W, A)

    def init(self, params, inp: DraftInput):
        """Level l, column i starts as the prompt's token l + i + 1 places before its end (any
        guess is exact; Jacobi iteration replaces them); the pool starts empty."""
        tokens_BxT, lengths_B = inp.tokens_BxT, inp.lengths_B
        B, A, Y = tokens_BxT.shape[0], self.ngram - 1, self.window
        back_AxY = jnp.arange(A)[:, None] + jnp.arange(Y)[None, :] + 1
        slots_BxAxY = jnp.maximum(lengths_B[:, None, None] - back_AxY, 0)
        window_BxAxY = jnp.take_along_axis(tokens_BxT, slots_BxAxY.reshape(B, -1), axis=1)
        return dict(window_BxAxY=window_BxAxY.reshape(B, A, Y),
                    pool_BxExA1=jnp.full((B, self.pool, self.ngram), -1, jnp.int32),
                    age_BxE=jnp.full((B, self.pool), -1, jnp.int32),
                    steps_B=jnp.zeros((B,), jnp.int32))

    def draft_tree(self, params, state, inp: DraftInput, key, sampling, tree) -> Draft:
        """The window's guesses, and the newest pooled n-grams that begin with the row's last
        token (a missing one repeats that token); q is one-hot."""
        tokens_BxT, lengths_B = inp.tokens_BxT, inp.lengths_B
        B, W = tokens_BxT.shape[0], self.candidates
        win_AxY, cand_WxA = self._nodes
        last_B = jnp.take_along_axis(tokens_BxT, (lengths_B - 1)[:, None], axis=1)[:, 0]
        pool_BxExA1, age_BxE = state["pool_BxExA1"], state["age_BxE"]
        match_BxE = (pool_BxExA1[..., 0] == last_B[:, None]) & (age_BxE >= 0)
        age_BxW, pick_BxW = jax.lax.top_k(jnp.where(match_BxE, age_BxE, -1), W)
        grams_BxWxA1 = jnp.take_along_axis(pool_BxExA1, pick_BxW[..., None], axis=1)
        grams_BxWxA = jnp.where(age_BxW[..., None] >= 0, grams_BxWxA1[..., 1:],
                                last_B[:, None, None])
        draft_BxN = jnp.zeros((B, tree.size), jnp.int32)
        draft_BxN = draft_BxN.at[:, win_AxY.reshape(-1)].set(
            state["window_BxAxY"].reshape(B, -1))
        draft_BxN = draft_BxN.at[:, cand_WxA.reshape(-1)].set(grams_BxWxA.reshape(B, -1))
        q = None if sampling.greedy else DraftProbs(jnp.ones((B, tree.size, 1)),
                                                    draft_BxN[..., None])
        return Draft(draft_BxN, q, state)

    def observe(self, params, state, logits_BxN1xV):
        """One Jacobi iteration from the target's logits at the root and every node: each
        column's next guess is the target's token after its top level; once the levels hold a
        full trajectory, each column's n-gram joins the pool (unless it is there already)."""
        win_AxY, _ = self._nodes
        B, A, Y = state["window_BxAxY"].shape
        top_BxYxV = jnp.take(logits_BxN1xV, win_AxY[-1] + 1, axis=1)  # feed index = node + 1
        next_BxY = argmax(top_BxYxV)
        window_BxAxY = state["window_BxAxY"]
        grams_BxYxA1 = jnp.concatenate([jnp.swapaxes(window_BxAxY, 1, 2), next_BxY[..., None]],
                                      axis=2)
        pool_BxExA1, age_BxE, steps_B = state["pool_BxExA1"], state["age_BxE"], state["steps_B"]
        full_B = steps_B >= A - 1  # every level was written by an iteration
        rows_B = jnp.arange(B)
        for i in range(Y):
            gram_BxA1 = grams_BxYxA1[:, i]
            known_B = jnp.any(jnp.all(pool_BxExA1 == gram_BxA1[:, None], axis=2) & (age_BxE >= 0),
                              axis=1)
            slot_B = jnp.argmin(age_BxE, axis=1)  # empty (-1) or the oldest
            put_B = full_B & ~known_B
            stamp_B = steps_B * Y + i
            pool_BxExA1 = pool_BxExA1.at[rows_B, slot_B].set(
                jnp.where(put_B[:, None], gram_BxA1, pool_BxExA1[rows_B, slot_B]))
            age_BxE = age_BxE.at[rows_B, slot_B].set(
                jnp.where(put_B, stamp_B, age_BxE[rows_B, slot_B]))
        window_BxAxY = jnp.concatenate([window_BxAxY[:, 1:], next_BxY[:, None]], axis=1)
        return dict(window_BxAxY=window_BxAxY, pool_BxExA1=pool_BxExA1, age_BxE=age_BxE,
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
