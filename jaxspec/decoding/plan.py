"""The cost model of speculative decoding: expected tokens per step over the measured cost of a
step, relative to plain decoding, for each draft length gamma.

A step with draft length gamma gains 1 + sum_{i<=gamma} prod_{j<=i} a_j tokens, where a_j is the
chance that draft j is accepted once drafts 1..j-1 were (all a_j = alpha gives Leviathan et al.'s
(1 - alpha^(g+1)) / (1 - alpha)), and costs s(gamma) plain steps: measured in the decode loop
(`profile.step_costs`), or estimated from its parts as gamma drafted tokens of c target steps
each plus a verification of gamma + 1 positions, r(gamma + 1) (`step_cost`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


def expected_tokens(accept_G, gamma: int) -> float:
    """Tokens gained per step with draft length `gamma`, from per-position acceptance
    `accept_G` (a float alpha stands for the same acceptance at every position)."""
    a = np.asarray(accept_G, np.float64)
    a = np.full(gamma, a) if a.ndim == 0 else a[:gamma]
    if len(a) < gamma:
        raise ValueError(f"acceptance given for {len(a)} positions, gamma is {gamma}")
    return float(1 + np.sum(np.cumprod(a)))


def position_counts(accept_lengths, draft_lengths, G: int) -> tuple[np.ndarray, np.ndarray]:
    """(accepted [G], reached [G]): per draft position j = 1..G, the steps that accepted draft j
    and the steps that drafted it with drafts 1..j-1 accepted, from the tokens gained at each
    step (accepted drafts + 1) and the draft length of each step (rows of either: lists)."""
    n = np.asarray([a - 1 for row in accept_lengths for a in row], np.int64)
    g = np.asarray([d for row in draft_lengths for d in row], np.int64)
    j_Gx1 = np.arange(1, G + 1)[:, None]
    accepted = np.sum(j_Gx1 <= n, axis=1).astype(np.float64)
    reached = np.sum(j_Gx1 <= np.minimum(n + 1, g), axis=1).astype(np.float64)
    return accepted, reached


def per_position_acceptance(accept_lengths, gamma: int) -> np.ndarray:
    """a_i = P(draft i accepted | drafts before it were), i = 1..gamma, counted from the tokens
    gained at each step of a run with draft length `gamma` (accepted drafts + 1). A step cut
    short by a stop token or the budget reads as a rejection: measure on long outputs."""
    accepted, reached = position_counts(accept_lengths,
                                        [[gamma] * len(row) for row in accept_lengths], gamma)
    return np.divide(accepted, reached, out=np.zeros(gamma), where=reached > 0)


def relative_cost(costs: dict, S: int) -> float:
    """Cost of verifying S positions relative to one, interpolated between measured sizes."""
    sizes = sorted(int(s) for s in costs)
    values = [float(costs[str(s)] if str(s) in costs else costs[s]) for s in sizes]
    if S > sizes[-1]:
        raise ValueError(f"no cost measured for {S} positions (largest: {sizes[-1]})")
    return float(np.interp(S, sizes, values))


def step_cost(gamma: int, costs: dict, c: float) -> float:
    """Target steps' worth of time for one speculative step, from its parts: gamma drafted
    tokens and a verification of gamma + 1 positions; gamma 0 is a plain step (1)."""
    return gamma * c + relative_cost(costs, gamma + 1)


@dataclasses.dataclass
class Plan:
    speedups: dict[int, float]  # gamma -> expected speedup over plain decoding
    accept_G: list[float]  # measured per-position acceptance
    costs_G1: list[float]  # step cost of each gamma, in plain steps

    @property
    def best_gamma(self) -> int:
        """The draft length of the highest expected speedup; 0 when none beats plain decoding."""
        g = max(self.speedups, key=self.speedups.get)
        return g if self.speedups[g] > 1 else 0

    def describe(self) -> str:
        rows = [f"gamma {g:2d}: expected {s:.3f}x" for g, s in self.speedups.items()]
        if self.best_gamma:
            verdict = f"best: gamma {self.best_gamma} ({self.speedups[self.best_gamma]:.3f}x)"
        else:
            verdict = ("no gamma pays: the drafter is accepted too rarely for its cost and the "
                       "cost of verifying; decode without it")
        accept = " ".join(f"{a:.2f}" for a in self.accept_G)
        costs = " ".join(f"{c:.3f}" for c in self.costs_G1)
        return "\n".join([f"per-position acceptance {accept}", f"step cost by gamma {costs}",
                          *rows, verdict])


def plan(accept_G, costs_G1, gammas) -> Plan:
    """Expected speedup of each gamma from acceptance and the step cost of each draft length
    0..G (`costs_G1`, in plain steps)."""
    return Plan({int(g): expected_tokens(accept_G, g) / float(costs_G1[g]) for g in gammas},
                [float(a) for a in np.atleast_1d(accept_G)], [float(c) for c in costs_G1])


class AcceptanceMemory:
    """What gamma="auto" learned of each drafter in earlier calls: per draft position, the
    accepted and reached counts of every step so far (scaled down past `cap` reached first
    drafts, so they follow a drifting workload). A call's rows start from them as `weight`
    tries at the remembered rates (`prior`), so a row does not probe a length the drafter's
    history already priced, and a position it never reached keeps `choose_gamma`'s prior."""

    def __init__(self, weight: float = 4.0, cap: float = 400.0):
        self.weight, self.cap = weight, cap
        self._counts: dict = {}

    def prior(self, key, G: int) -> np.ndarray:
        """Starting counts [2, G] (accepted, tried) for a row of a call keyed `key`."""
        accepted, reached = self._counts.get(key, (np.zeros(G), np.zeros(G)))
        rate = np.divide(accepted, reached, out=np.zeros(G), where=reached > 0)
        tried = np.where(reached > 0, self.weight, 0.0)
        return np.stack([rate * tried, tried]).astype(np.float32)

    def update(self, key, accept_lengths, draft_lengths, G: int) -> None:
        accepted, reached = position_counts(accept_lengths, draft_lengths, G)
        old = self._counts.get(key, (np.zeros(G), np.zeros(G)))
        accepted, reached = accepted + old[0], reached + old[1]
        scale = min(1.0, self.cap / max(reached[0], 1.0))
        self._counts[key] = (accepted * scale, reached * scale)

    def clear(self) -> None:
        self._counts.clear()


# The acceptance prior of the first draft: 2 tries at 1/4; each row's counts decay by
# `speculative._MEMORY` (0.95) a step. Chosen by replaying the de->en EAGLE head's accept
# lengths at gamma 4 on the 79 benchmark questions under its measured step costs (1, 1.08,
# 1.13, 1.18, 1.28; docs/results/auto_gamma_sim.py): auto gains 0.985 of gamma 1's modelled
# speedup (stronger priors gain up to 0.99 but cost a useless drafter 5% on 30-token rows,
# against 2.7% with this one). A call after the first starts from `AcceptanceMemory` instead
# (4 tries at the remembered rates: 0.993 of gamma 1 in the same replay).
PRIOR_ACCEPTED, PRIOR_TRIED = 0.5, 2.0
# A trained drafter's recorded acceptance (`Drafter.tuned_accept`) counts as this many tries.
TUNED_TRIES = 8.0


def start_counts(remembered, tuned_accept, G: int) -> np.ndarray:
    """A row's starting acceptance counts [2, G] (accepted, tried) for gamma="auto": what earlier
    calls measured (`AcceptanceMemory.prior`, None when not remembered) where they reached a
    position, else the drafter's acceptance recorded when it was tuned, as TUNED_TRIES tries
    per position; positions neither covers start empty (`choose_gamma`'s prior)."""
    counts = np.zeros((2, G), np.float32)
    if tuned_accept is not None:
        rates = np.asarray(tuned_accept, np.float32)[:G]
        counts[:, :len(rates)] = [rates * TUNED_TRIES, np.full(len(rates), TUNED_TRIES)]
    if remembered is not None:
        counts = np.where(remembered[1] > 0, remembered, counts)
    return counts.astype(np.float32)


# A longer draft is chosen over a shorter one only when it promises MARGIN more tokens per unit
# of time: step costs measured on a busy machine move by a few percent from run to run, and the
# lengths' modelled gains often lie within 1-2% of each other (Gemma 3 bfloat16 with a head
# accepted ~30% of the time: gamma 1 and 2), so without it the same sentence drafted
# differently in two runs.
MARGIN = 0.1


def choose_gamma(accepted_BxG, tried_BxG, costs_G1, margin: float | None = None):
    """Per row, a draft length 0..G from `costs_G1` (the step cost of each length, an array)
    and the row's acceptance of each draft position j, given that the drafts before it were
    accepted: a_1 = (accepted_1 + PRIOR_ACCEPTED) / (tried_1 + PRIOR_TRIED), and a_j =
    (accepted_j + PRIOR_TRIED * a_(j-1)) / (tried_j + PRIOR_TRIED), where tried_j counts the
    steps that reached draft j. A position not yet reached is expected to do as well as the one
    before it, so a row tries longer drafts when its first ones are accepted; once tried, each
    position has its own rate, so a drafter whose later drafts fail more often than its first
    stops drafting them. The row drafts when some length's expected speedup beats a plain
    step, and then takes the shortest length within `margin` of the best."""
    a_B = (accepted_BxG[:, 0] + PRIOR_ACCEPTED) / (tried_BxG[:, 0] + PRIOR_TRIED)
    a = [a_B]
    for j in range(1, accepted_BxG.shape[1]):
        a.append((accepted_BxG[:, j] + PRIOR_TRIED * a[-1]) / (tried_BxG[:, j] + PRIOR_TRIED))
    prod_BxG = jnp.cumprod(jnp.stack(a, axis=1), axis=1)
    tokens_BxG1 = jnp.cumsum(jnp.concatenate([jnp.ones_like(a_B)[:, None], prod_BxG], axis=1),
                             axis=1)
    margin = MARGIN if margin is None else margin
    gain_BxG1 = tokens_BxG1 / jnp.asarray(costs_G1, jnp.float32)
    best_B = jnp.max(gain_BxG1, axis=1)
    near_BxG = gain_BxG1[:, 1:] * (1 + margin) >= best_B[:, None]
    return jnp.where(jnp.argmax(gain_BxG1, axis=1) == 0, 0,
                     jnp.argmax(near_BxG, axis=1) + 1).astype(jnp.int32)
