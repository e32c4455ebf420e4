"""`jaxspec tune-tree`: a static token tree chosen from measured acceptance and measured cost
(Sequoia, Chen et al. 2024).

Acceptance p[d][r]: the chance that the rank-r candidate at depth d is the target's greedy token
once its parent was. A full tree (every node has the top `width` candidates as children,
`depth` deep) holds the matching candidate at each depth if any does, so a full-tree step's
accepted path reveals the matching rank at each depth. The measurement replays a full-tree
decode without its loop: greedy output is the target's own text, and a drafter's proposal is a
function of that text (a drafter state filled past a row's length is rolled back by lowering the
length: the drafter protocol). So the drafter fills its state once per prompt over the whole
text, drafts the full tree at every position of it in batched calls, and the accepted path at a
position is the descent that matches the text. Walking the steps a full-tree decode takes (the
next step starts past what this one gained) gives the counts, and the decode's own gains.

The choice: `best_tree`, with the verify cost of N + 1 positions from `jaxspec profile` and the
drafter's cost per depth level.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import speculative
from jaxspec.decoding.plan import relative_cost
from jaxspec.decoding.runner import cache_len
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.skip_search import greedy_texts
from jaxspec.decoding.trees import Tree, full_tree, make_tree
from jaxspec.drafters.base import DraftInput
from jaxspec.drafters.model import as_drafter
from jaxspec.errors import UserError

_ROWS = 8  # positions drafted per call


def positive(**sizes) -> None:
    """Refuse a size that is not an int >= 1."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise UserError(f"{name} must be an int >= 1, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Acceptance:
    hits_AxW: np.ndarray  # steps whose rank-r candidate at depth d + 1 was the target's token
    tried_A: np.ndarray  # steps that reached depth d + 1: its parent matched, the text goes on
    gains: list[list[int]]  # tokens gained at each step of the full-tree decode, per prompt

    @property
    def p_AxW(self) -> np.ndarray:
        tried_Ax1 = self.tried_A[:, None]
        return np.divide(self.hits_AxW, tried_Ax1, out=np.zeros(self.hits_AxW.shape),
                         where=tried_Ax1 > 0)

    def describe(self) -> str:
        A, W = self.hits_AxW.shape
        steps = sum(map(len, self.gains))
        tau = sum(map(sum, self.gains)) / max(steps, 1)
        rows = [f"acceptance over {steps} steps of the full tree (width {W}, depth {A}; "
                f"tau {tau:.3f}): p[depth][rank] given the parent matched",
                "depth  steps" + "".join(f"  rank {r}" for r in range(W))]
        rows += [f"{d + 1:5d} {int(self.tried_A[d]):6d}" + "".join(f" {p:7.3f}" for p in row)
                 for d, row in enumerate(self.p_AxW)]
        return "\n".join(rows)


_prefill = jax.jit(speculative.prefill, static_argnums=1)


@functools.partial(jax.jit, static_argnames=("config", "tree"))
def _draft_rows(drafter, dstate, feats_BxTxD, tokens_BxT, cache, prompt_R, lengths_R, *, config,
                tree):
    """The drafter's `tree` [R, N] at lengths_R of prompts prompt_R, from per-prompt states and
    target caches over the whole text (tokens past a row's length are padding, as in a decode;
    a drafter sees the cache only up to its position)."""
    T = tokens_BxT.shape[1]
    tokens_RxT = jnp.where(jnp.arange(T) < lengths_R[:, None], tokens_BxT[prompt_R],
                           config.pad_token_id)
    dstate_R = jax.tree.map(lambda x: x[prompt_R], dstate)
    inp = DraftInput(tokens_RxT, lengths_R, feats_BxTxD[prompt_R], config.vocab_size,
                     jax.tree.map(lambda x: x[prompt_R], cache))
    return drafter.spec.propose(drafter.params, dstate_R, inp, jax.random.key(0), Sampling(),
                                tree).tokens_BxN


def _ranks(tree: Tree, draft_RxN, next_RxA) -> np.ndarray:
    """Rank of the accepted node at each depth [R, A] (-1: none): descend from the root to the
    first child in rank order whose token is the target's next one (`next_RxA`; -1 past the
    text), as greedy `speculative.accept` does."""
    R, A = next_RxA.shape
    rows_R = np.arange(R)
    rank_RxA = np.full((R, A), -1)
    node_R, live_R = np.zeros(R, int), np.ones(R, bool)  # feed index of the last accepted node
    for d in range(A):
        kid_RxW = tree.children_N1xW[node_R]
        match_RxW = draft_RxN[rows_R[:, None], kid_RxW] == next_RxA[:, d, None]
        live_R &= match_RxW.any(axis=1)
        kid_R = kid_RxW[rows_R, np.argmax(match_RxW, axis=1)]
        rank_RxA[live_R, d] = tree.rank_N[kid_R[live_R]]
        node_R = np.where(live_R, kid_R + 1, node_R)
    return rank_RxA


def _drafts(target, drafter, tree: Tree, tokens_BxT, end_B, prompt_R, lengths_R) -> np.ndarray:
    """The drafter's `tree` [R, N] at length lengths_R of prompt prompt_R: its state filled once
    per prompt over the whole text (end_B tokens), rolled back per row by its length."""
    c = target.config
    state = _prefill(target.params, c, drafter, jnp.asarray(tokens_BxT), jnp.asarray(end_B),
                     jnp.zeros(len(end_B), jnp.int32), jax.random.key(0))
    R = len(lengths_R)
    pad = -R % _ROWS  # one call shape: repeat the first row
    fixed = lambda x: jnp.asarray(np.concatenate([x, np.full(pad, x[0])]), jnp.int32)  # noqa
    prompt_R, lengths_R = fixed(prompt_R), fixed(lengths_R)
    return np.concatenate([np.asarray(_draft_rows(
        drafter, state.drafter_state, state.features_BxTxD, state.tokens_BxT, state.target_cache,
        prompt_R[i:i + _ROWS], lengths_R[i:i + _ROWS], config=c, tree=tree))
        for i in range(0, R + pad, _ROWS)])[:R]


def _walk(gain_R, start_B, end_B) -> list[list[int]]:
    """Row indices of the steps a decode gaining gain_R at each row takes, per prompt (rows:
    lengths start_B .. end_B - 1 of each prompt in turn)."""
    steps, first = [], 0
    for s, e in zip(start_B, end_B):
        t, row = s, []
        while t < e:
            row.append(first + t - s)
            t += gain_R[row[-1]]
        steps.append(row)
        first += e - s
    return steps


def acceptance(target, drafter, prompts, width: int, depth: int, max_new_tokens: int = 64,
               **generate_kw) -> Acceptance:
    """p[d][r] of `drafter` for `target`, greedy, on the target's own continuations of `prompts`
    (module docstring); `generate_kw`: chat, stop."""
    positive(width=width, depth=depth)
    drafter = as_drafter(drafter, target)
    if not drafter.spec.drafts_trees:
        raise UserError(f"drafter {type(drafter.spec).__name__} cannot draft trees")
    drafter.spec.validate(drafter.params, target)
    tree = full_tree([width] * depth)
    text_BxL, weight_BxL = greedy_texts(target, prompts, max_new_tokens, **generate_kw)
    # Weight marks the positions whose next token was generated: steps start at lengths
    # start .. end - 1 (end: the text's length).
    start_B = np.argmax(weight_BxL, axis=1) + 1
    end_B = start_B + weight_BxL.sum(axis=1).astype(int)
    B, L = text_BxL.shape
    T = cache_len(start_B, end_B - start_B, tree.size, target.config.max_position,
                  f"{tree.size} nodes of the full tree")
    tokens_BxT = np.full((B, T), target.config.pad_token_id, np.int32)
    tokens_BxT[:, :L] = text_BxL
    prompt_R = np.concatenate([np.full(e - s, p) for p, (s, e) in enumerate(zip(start_B, end_B))])
    lengths_R = np.concatenate([np.arange(s, e) for s, e in zip(start_B, end_B)])
    draft_RxN = _drafts(target, drafter, tree, tokens_BxT, end_B, prompt_R, lengths_R)
    pos_RxA = lengths_R[:, None] + np.arange(depth)  # of the target's token at each depth
    inside_RxA = pos_RxA < end_B[prompt_R][:, None]
    next_RxA = np.where(inside_RxA, tokens_BxT[prompt_R[:, None], pos_RxA], -1)
    rank_RxA = _ranks(tree, draft_RxN, next_RxA)
    n_R = (rank_RxA >= 0).sum(axis=1)
    gain_R = np.minimum(n_R + 1, end_B[prompt_R] - lengths_R)  # the budget cuts the last step
    steps = _walk(gain_R, start_B, end_B)
    walked = [i for row in steps for i in row]  # the rows the walk drafts at
    rank_RxA, tried_RxA = rank_RxA[walked], ((np.arange(depth) <= n_R[walked, None])
                                             & inside_RxA[walked])
    hits_AxW = np.zeros((depth, width), np.int64)
    r, d = np.nonzero(rank_RxA >= 0)
    np.add.at(hits_AxW, (d, rank_RxA[r, d]), 1)
    return Acceptance(hits_AxW, tried_RxA.sum(axis=0), [gain_R[row].tolist() for row in steps])


def growth(p_AxW, budget: int, max_depth: int) -> list[tuple[tuple[int, ...], float]]:
    """Up to `budget` nodes (path, path probability) of trees at most `max_depth` deep, in the
    order the greedy adds them: each time the frontier node of the highest path probability (the
    product of p along its path; ties: the shallower). A node's children join the frontier one
    at a time in rank order: rank 0 when the node is added, rank r + 1 when rank r is."""
    W = p_AxW.shape[1]
    frontier = {(0,): (p_AxW[0, 0], 1.0)}  # path -> (its probability, its parent's)
    out = []
    while frontier and len(out) < budget:
        path = max(frontier, key=lambda q: (frontier[q][0], -len(q)))
        prob, parent = frontier.pop(path)
        out.append((path, float(prob)))
        d, r = len(path), path[-1]
        if r + 1 < W:
            frontier[path[:-1] + (r + 1,)] = (parent * p_AxW[d - 1, r + 1], parent)
        if d < max_depth:
            frontier[path + (0,)] = (prob * p_AxW[d, 0], prob)
    return out


@dataclasses.dataclass(frozen=True)
class Pick:
    tree: Tree
    tau: float  # expected tokens per step
    speedup: float  # expected, over plain decoding


@dataclasses.dataclass(frozen=True)
class Choice:
    best: Pick  # the tree of the highest expected speedup
    chain: Pick  # the best chain (width 1), for comparison

    def describe(self) -> str:
        b, ch = self.best, self.chain
        paths = ", ".join(str(list(p)) for p in b.tree.paths)
        lines = [f"chosen tree: {b.tree.size} nodes, depth {b.tree.max_depth}: [{paths}]",
                 f"expected tau {b.tau:.3f}, {b.speedup:.3f}x over plain decoding; the best "
                 f"chain (gamma {ch.tree.size}): tau {ch.tau:.3f}, {ch.speedup:.3f}x"]
        if b.speedup <= 1:
            lines.append("no tree pays: the drafter is accepted too rarely for its cost and the "
                         "cost of verifying")
        return "\n".join(lines)


def check_budget(budget: int, costs: dict) -> None:
    """A tree of `budget` nodes verifies budget + 1 positions: their cost must be measured."""
    positive(budget=budget)
    largest = max(int(s) for s in costs)
    if budget + 1 > largest:
        raise UserError(f"budget {budget} needs the cost of verifying {budget + 1} positions; "
                        f"the profile measured up to {largest}: give a budget of at most "
                        f"{largest - 1}")


def _best(p_AxW, costs: dict, c: float, budget: int) -> Pick:
    """Of the grown trees of every size and depth limit, the one of the highest expected
    speedup."""
    best = None
    for k in range(1, p_AxW.shape[0] + 1):
        nodes = growth(p_AxW, budget, k)
        tau_N = 1 + np.cumsum([prob for _, prob in nodes])
        depth_N = np.maximum.accumulate([len(path) for path, _ in nodes])
        speed_N = [tau_N[n] / (relative_cost(costs, n + 2) + c * depth_N[n])
                   for n in range(len(nodes))]
        n = int(np.argmax(speed_N))  # ties: the smaller tree
        if best is None or speed_N[n] > best.speedup:
            best = Pick(make_tree([path for path, _ in nodes[:n + 1]]), float(tau_N[n]),
                        float(speed_N[n]))
    return best


def best_tree(p_AxW, costs: dict, c: float, budget: int) -> Choice:
    """The tree of at most `budget` nodes of the highest expected speedup, and the best chain.

    A tree gains E = 1 + the sum of its nodes' path probabilities per step (the product of p
    along the path: acceptance by depth and rank, taken as independent of the path) and costs
    the verification of its nodes + 1 positions (`costs`: relative to one, `jaxspec profile`)
    plus c per depth level: drafters draft a tree with one call per level (jaxspec/drafters/:
    hidden.py), a chain with one per token (the profile's c).

    `growth` gives nested trees of 1 .. budget nodes, each of the highest E of its size: a node
    weighs no more than the one it needs first (its parent, or its elder sibling when p falls
    with rank), so the n heaviest nodes form a tree, and growth takes them. The drafter's cost
    grows with depth, so growth runs once per depth limit; the best E / cost of all is optimal.
    """
    p_AxW = np.asarray(p_AxW, np.float64)
    if p_AxW.ndim != 2 or 0 in p_AxW.shape or not ((p_AxW >= 0) & (p_AxW <= 1)).all():
        raise UserError(f"acceptance must be probabilities [depth, width], got {p_AxW.tolist()}")
    if not c >= 0:
        raise UserError(f"the drafter's cost c must be >= 0, got {c}")
    check_budget(budget, costs)
    return Choice(_best(p_AxW, costs, c, budget), _best(p_AxW[:, :1], costs, c, budget))


def bench_config(choice: Choice, acc: Acceptance, run: dict, drafter: str) -> str:
    """A `jaxspec bench --config` file: `drafter` (its --drafter spec) with the chosen tree and
    as the best chain, against plain decoding; the measurement's figures in its header."""
    import datetime
    import json

    import yaml

    b, ch = choice.best, choice.chain
    A, W = acc.hits_AxW.shape
    head = [f"Written by `jaxspec tune-tree` on {datetime.date.today()}: acceptance over "
            f"{sum(map(len, acc.gains))} steps of the full tree of width {W}, depth {A}.",
            f"Chosen: {b.tree.size} nodes, depth {b.tree.max_depth}; expected tau {b.tau:.3f}, "
            f"{b.speedup:.3f}x; the best chain, gamma {ch.tree.size}: tau {ch.tau:.3f}, "
            f"{ch.speedup:.3f}x."]
    if b.speedup <= 1:
        head.append("No tree is expected to pay on this machine; bench it to confirm.")
    method = drafter if drafter.partition(":")[0] in ("ngram", "layerskip", "drafter") \
        else f"drafter:{drafter}"
    body = {**run, "gammas": [ch.tree.size],
            "tree": json.dumps([list(p) for p in b.tree.paths]), "methods": ["ar", method]}
    return "".join(f"# {line}\n" for line in head) + yaml.safe_dump(body, sort_keys=False,
                                                                     allow_unicode=True)
