"""Token trees: a static topology from Medusa/EAGLE "choices" paths, drafting a tree's nodes,
and moving the accepted path into place in a cache.

A tree of N draft nodes hangs under the root, the row's last token. The node with path
(r1, ..., rd) is the rank-rd candidate after node (r1, ..., r(d-1)). Nodes are numbered by depth,
then path, so parents come first and siblings sit in rank order. A step scores feed index 0 (the
root) and k = i + 1 (node i) in one target call: slot base + k of the cache holds feed index k
(base = length - 1) while the step runs, and a query sees the committed prefix and its own
ancestors; `compact` then moves the accepted path to slots base + depth. A chain of gamma drafts
is the tree [(0,), (0, 0), ...], whose slots already hold their positions.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.sampling import DraftProbs, Sampling, argmax, probs, sample
from jaxspec.errors import UserError


@dataclasses.dataclass(frozen=True)
class Tree:
    """Static topology: hashable, so a jit static argument. Build with `make_tree` or `chain`."""

    paths: tuple[tuple[int, ...], ...]  # sorted by depth, then path

    @property
    def size(self) -> int:
        return len(self.paths)

    @functools.cached_property
    def depth_N1(self) -> np.ndarray:
        """Depth of each feed index (the root: 0)."""
        return np.array([0] + [len(p) for p in self.paths], np.int32)

    @property
    def max_depth(self) -> int:
        return int(self.depth_N1.max())

    @functools.cached_property
    def parent_N(self) -> np.ndarray:
        """Feed index of each node's parent (the root: 0)."""
        feed = {p: i + 1 for i, p in enumerate(self.paths)} | {(): 0}
        return np.array([feed[p[:-1]] for p in self.paths], np.int32)

    @functools.cached_property
    def rank_N(self) -> np.ndarray:
        return np.array([p[-1] for p in self.paths], np.int32)

    @functools.cached_property
    def ancestors_N1xN1(self) -> np.ndarray:
        """[k, j]: feed index j is k or an ancestor of k (the root is everyone's)."""
        a = np.eye(self.size + 1, dtype=bool)
        for i, parent in enumerate(self.parent_N):
            a[i + 1] |= a[parent]
        return a

    @functools.cached_property
    def children_N1xW(self) -> np.ndarray:
        """Node indices of each feed index's children in rank order, padded with -1."""
        kids = [[] for _ in range(self.size + 1)]
        for i, parent in enumerate(self.parent_N):
            kids[parent].append(i)
        out = np.full((self.size + 1, max(1, max(map(len, kids)))), -1, np.int32)
        for k, row in enumerate(kids):
            out[k, :len(row)] = row
        return out

    @functools.cached_property
    def path_N1xA1(self) -> np.ndarray:
        """[k, d]: feed index k's ancestor at depth d, k itself past its own depth."""
        out = np.zeros((self.size + 1, self.max_depth + 1), np.int32)
        for k in range(1, self.size + 1):
            for j in np.flatnonzero(self.ancestors_N1xN1[k]):
                out[k, self.depth_N1[j]:] = j
        return out

    @property
    def is_chain(self) -> bool:
        return self.paths == chain(self.size).paths

    def level(self, d: int) -> np.ndarray:
        """Node indices at depth d."""
        return np.flatnonzero(self.depth_N1[1:] == d)

    def region(self, base_B, nodes=None):
        """`forward`'s `tree` argument for queries at these nodes (default: the root and every
        node, in feed order) over the tree in slots base_B ...: each sees its ancestors."""
        rows = slice(None) if nodes is None else np.asarray(nodes) + 1
        return base_B, self.depth_N1, self.ancestors_N1xN1[rows]


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree (Li et al. 2024), greedy: every step and row the drafter expands
    the `width` most likely nodes of each depth (by path probability) into their `width` most
    likely children, down to `depth`, and the target verifies the `budget` nodes of highest
    path probability. The settings are static; each row's topology is data (`RowTree`)."""

    budget: int
    depth: int
    width: int

    def __post_init__(self):
        if min(self.budget, self.depth, self.width) < 1:
            raise UserError(f"a dynamic tree needs budget, depth and width >= 1, got {self}")
        if self.budget > self.candidates:
            raise UserError(f"a dynamic tree of depth {self.depth} and width {self.width} "
                            f"drafts {self.candidates} candidates; budget {self.budget} is more")

    @property
    def candidates(self) -> int:
        return self.width + (self.depth - 1) * self.width ** 2

    @property
    def expanded(self) -> int:
        """Nodes the drafter expands (each in a scratch slot of its cache): width per depth
        but the last."""
        return self.width * (self.depth - 1)

    size = property(lambda self: self.budget)
    max_depth = property(lambda self: self.depth)
    is_chain = False


@flax.struct.dataclass
class RowTree:
    """One step's dynamic tree, a topology per row: the feed index of each node's parent
    [B, N] (0: the root; -1: none, a node never accepted) and each feed index's depth [B, N+1].
    Nodes come in feed order, parents first."""

    parent_BxN: jnp.ndarray
    depth_N1: jnp.ndarray  # [B, N + 1]

    @property
    def ancestors_BxN1xN1(self):
        """[b, k, j]: feed index j is k or an ancestor of k in row b."""
        B, N = self.parent_BxN.shape
        eye_N1xN1 = jnp.eye(N + 1, dtype=bool)
        rows = [jnp.broadcast_to(eye_N1xN1[0], (B, N + 1))]
        for i in range(N):
            par_B = jnp.maximum(self.parent_BxN[:, i], 0)
            rows.append(jnp.stack(rows, axis=1)[jnp.arange(B), par_B] | eye_N1xN1[i + 1])
        return jnp.stack(rows, axis=1)

    def region(self, base_B):
        """`forward`'s `tree` argument for the root and every node (see `Tree.region`)."""
        return base_B, self.depth_N1, self.ancestors_BxN1xN1


def make_tree(choices) -> Tree | DynamicTree:
    """A tree from Medusa/EAGLE "choices" (see `make_tree_paths`), a `Tree`, or a `DynamicTree`
    (also as "dynamic:BUDGET[:DEPTH[:WIDTH]]", depth 4 and width 4 by default)."""
    if isinstance(choices, (Tree, DynamicTree)):
        return choices
    if isinstance(choices, str) and choices.startswith("dynamic"):
        parts = choices.split(":")[1:]
        if not parts or len(parts) > 3 or not all(p.isdigit() for p in parts):
            raise UserError(f"a dynamic tree is dynamic:BUDGET[:DEPTH[:WIDTH]], got {choices!r}")
        budget, depth, width = (list(map(int, parts)) + [4, 4])[:3]
        return DynamicTree(budget, depth, width)
    return make_tree_paths(choices)


def chain(n: int) -> Tree:
    """n drafts in a row: gamma = n."""
    return Tree(tuple((0,) * d for d in range(1, n + 1)))


def make_tree_paths(choices) -> Tree:
    """A tree from Medusa/EAGLE "choices" (paths of candidate ranks, e.g. [(0,), (1,), (0, 0)]),
    checked: non-empty paths of ranks >= 0, no duplicates, and each path's parent present."""
    paths = []
    for c in choices:
        if isinstance(c, (str, bytes)) or not hasattr(c, "__iter__"):
            raise UserError(f"a tree path is a sequence of ranks, got {c!r}")
        p = tuple(c)
        if not p or any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0
                        for r in p):
            raise UserError(f"a tree path is a non-empty sequence of ranks >= 0, got {c!r}")
        paths.append(tuple(int(r) for r in p))
    if not paths:
        raise UserError("a tree needs at least one node")
    if len(set(paths)) < len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise UserError(f"tree path {dup} is given twice")
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise UserError(f"tree paths are not prefix-closed: {p} has no parent {p[:-1]}")
    return Tree(tuple(sorted(paths, key=lambda p: (len(p), p))))


def with_branch(tree: Tree, n: int) -> Tree:
    """`tree` and a chain of n more nodes under the root, its last-ranked child (`branch`)."""
    rank = 1 + max(p[0] for p in tree.paths)
    return make_tree_paths(tree.paths + tuple((rank,) + (0,) * d for d in range(n)))


def branch(tree: Tree) -> tuple[Tree, np.ndarray, np.ndarray]:
    """Split off what `with_branch` added: (the rest of the tree, the node indices of the rest,
    those of the branch, root to leaf). The branch is the root's last-ranked child and its
    descendants, which must form a chain."""
    rank = max(p[0] for p in tree.paths)
    rest = tuple(p for p in tree.paths if p[0] != rank)
    chain_ = tuple(p for p in tree.paths if p[0] == rank)
    if not rest or chain_ != tuple((rank,) + (0,) * d for d in range(len(chain_))):
        raise UserError(f"tree {tree.paths} has no branch: its last root child must head a "
                        f"chain beside other nodes")
    index = {p: i for i, p in enumerate(tree.paths)}
    return (Tree(rest), np.array([index[p] for p in rest], np.int32),
            np.array([index[p] for p in chain_], np.int32))


def full_tree(widths) -> Tree:
    """Every node at depth d has widths[d] children (a Medusa-style Cartesian tree)."""
    paths, level = [], [()]
    for w in widths:
        level = [p + (r,) for p in level for r in range(int(w))]
        paths += level
    return make_tree_paths(paths)


def _draw(key, logits_xK, W: int, sampling: Sampling):
    """W candidates [..., W] of each distribution, and for each the distribution it was drawn
    from [..., W, K] (None when greedy): the W most likely ids (greedy), or W draws without
    replacement, draw r from what the earlier draws left, renormalised."""
    if sampling.greedy:
        x, out = logits_xK, []
        for _ in range(W):
            out.append(argmax(x))
            x = jnp.where(jax.nn.one_hot(out[-1], x.shape[-1], dtype=bool), -jnp.inf, x)
        return jnp.stack(out, axis=-1), None
    m = probs(logits_xK, sampling)
    ids, qs = [], []
    for k in jax.random.split(key, W):
        qs.append(m / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1e-30))
        ids.append(sample(k, m))
        m = jnp.where(jax.nn.one_hot(ids[-1], m.shape[-1], dtype=bool), 0.0, m)
    return jnp.stack(ids, axis=-1), jnp.stack(qs, axis=-2)


def grow(tree: Tree, key, sampling: Sampling, root_logits_BxK, expand, carry, ids_K=None):
    """Draft every node of `tree` from per-node distributions over K head entries (`ids_K` maps
    them to token ids; None: entry k is token k). A node's children are its distribution's top
    candidates in rank order (greedy), or draws without replacement from it (sampling): each
    child comes with the distribution it was drawn from, the verifier's q.

    `root_logits_BxK` is the root's distribution; expand(d, nodes, tok_BxP, carry) ->
    (logits_BxPxK, carry) gives those of the depth-d `nodes` (numpy indices: the ones with
    children) from their tokens. Returns draft [B, N], q (DraftProbs; None when greedy), carry."""
    N, A = tree.size, tree.max_depth
    draft, q = [None] * N, [None] * N
    logits_BxPxK, parents = root_logits_BxK[:, None], [0]
    for d, k in zip(range(1, A + 1), jax.random.split(key, A)):
        level = tree.level(d)
        W = int(tree.rank_N[level].max()) + 1
        idx_BxPxW, q_BxPxWxK = _draw(k, logits_BxPxK, W, sampling)
        for i in level:
            j, r = parents.index(int(tree.parent_N[i])), int(tree.rank_N[i])
            draft[i] = idx_BxPxW[:, j, r]
            q[i] = None if q_BxPxWxK is None else q_BxPxWxK[:, j, r]
        inner = np.array([i for i in level if (tree.parent_N == i + 1).any()], np.int32)
        if len(inner):
            tok_BxP = jnp.stack([draft[i] for i in inner], axis=1)
            tok_BxP = tok_BxP if ids_K is None else ids_K[tok_BxP]
            logits_BxPxK, carry = expand(d, inner, tok_BxP, carry)
            parents = [int(i) + 1 for i in inner]
    draft_BxN = jnp.stack(draft, axis=1)
    draft_BxN = draft_BxN if ids_K is None else ids_K[draft_BxN]
    if sampling.greedy:
        return draft_BxN, None, carry
    q_BxNxK = jnp.stack(q, axis=1)
    ids = None if ids_K is None else jnp.broadcast_to(ids_K, q_BxNxK.shape)
    return draft_BxN, DraftProbs(q_BxNxK, ids), carry


def compact(cache, base_B, path_BxA1, n_B):
    """Move the keys/values of each row's accepted path (feed indices path[:, 1:n + 1], in
    scratch slots base + feed index) to slots base + depth, so slot t holds position t again.
    Sources never lie below their destinations, so one gather then one scatter does it."""
    B, A1 = path_BxA1.shape
    T = cache.max_len
    rows_Bx1 = jnp.arange(B)[:, None]
    d_A = jnp.arange(1, A1)
    src_BxA = base_B[:, None] + path_BxA1[:, 1:]
    dst_BxA = jnp.where(d_A <= n_B[:, None], base_B[:, None] + d_A, T)
    move = lambda x: x.at[rows_Bx1, dst_BxA].set(x[rows_Bx1, jnp.minimum(src_BxA, T - 1)],
                                                 mode="drop")
    return cache.replace(keys=tuple(map(move, cache.keys)),
                         values=tuple(map(move, cache.values)))
