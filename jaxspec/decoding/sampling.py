"""Temperature, top-k and top-p, applied the same way to target and drafter distributions."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.errors import UserError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling settings; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits_xV, s: Sampling):
    """The processed distribution [..., V] that tokens are drawn from (float32)."""
    logits = logits_xV.astype(jnp.float32) / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, s.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    p = jax.nn.softmax(logits, axis=-1)
    if s.top_p is not None and s.top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        sorted_p = jnp.sort(p, axis=-1)[..., ::-1]
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        n_keep = jnp.sum(mass_before < s.top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_p, n_keep - 1, axis=-1)
        p = jnp.where(p >= threshold, p, 0.0)
        p = p / jnp.sum(p, axis=-1, keepdims=True)
    return p


def argmax(logits_xV, block: int = 1024):
    """jnp.argmax over the last axis (first index of the maximum), in two passes: the maximum of
    each block of `block` ids, then the winning block. XLA:CPU's one-pass argmax over a large
    vocabulary is ~10x slower (Gemma 3's 262,144 ids)."""
    *lead, V = logits_xV.shape
    if V <= block:
        return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32)
    x = jnp.pad(logits_xV, [(0, 0)] * len(lead) + [(0, -V % block)], constant_values=-jnp.inf)
    x_xOxK = x.reshape(*lead, -1, block)
    blk_x = jnp.argmax(jnp.max(x_xOxK, axis=-1), axis=-1)
    in_blk_xK = jnp.take_along_axis(x_xOxK, blk_x[..., None, None], axis=-2)[..., 0, :]
    return (blk_x * block + jnp.argmax(in_blk_xK, axis=-1)).astype(jnp.int32)


def _first_above(cum, u_x, mass):
    """Index of the first entry on the last axis whose running sum `cum` exceeds u, never one
    with zero mass."""
    n_x = jnp.sum(cum <= u_x[..., None], axis=-1)
    last_x = cum.shape[-1] - 1 - jnp.argmax(jnp.flip(mass > 0, axis=-1), axis=-1)  # with mass
    return jnp.minimum(n_x, last_x)


def sample(key, p_xV, block: int = 1024):
    """Draw one id from each distribution `p_xV` (unnormalised mass is fine) by inverting its
    CDF in two levels (block sums, then within the block): one uniform number per row, where
    `jax.random.categorical` draws V Gumbel numbers (~30x slower on CPU for Gemma 3's
    vocabulary)."""
    *lead, V = p_xV.shape
    p = jnp.pad(p_xV, [(0, 0)] * len(lead) + [(0, -V % block)])
    p_xOxK = p.reshape(*lead, -1, block)
    mass_xO = jnp.sum(p_xOxK, axis=-1)
    cum_xO = jnp.cumsum(mass_xO, axis=-1)
    u_x = jax.random.uniform(key, tuple(lead)) * cum_xO[..., -1]
    blk_x = _first_above(cum_xO, u_x, mass_xO)
    before_x = jnp.take_along_axis(cum_xO - mass_xO, blk_x[..., None], axis=-1)[..., 0]
    in_xK = jnp.take_along_axis(p_xOxK, blk_x[..., None, None], axis=-2)[..., 0, :]
    idx_x = _first_above(jnp.cumsum(in_xK, axis=-1), u_x - before_x, in_xK)
    return (blk_x * block + idx_x).astype(jnp.int32)


def pick(key, logits_xV, s: Sampling):
    """(token ids [...], distribution [..., V] or None when greedy)."""
    if s.greedy:
        return argmax(logits_xV), None
    p = probs(logits_xV, s)
    return sample(key, p), p


@flax.struct.dataclass
class DraftProbs:
    """q, the distribution each draft was drawn from, kept as the mass `probs_BxGxK` on token ids
    `ids_BxGxK` (zero elsewhere): K = 1 for a one-hot draft, the head size for a head over a
    subset of the vocabulary. `ids_BxGxK` is None when K is the whole vocabulary (a full head)."""

    probs_BxGxK: jnp.ndarray
    ids_BxGxK: jnp.ndarray | None = None

    def of(self, draft_BxG):
        """q of each draft token [B, G]."""
        if self.ids_BxGxK is None:
            return jnp.take_along_axis(self.probs_BxGxK, draft_BxG[..., None], axis=-1)[..., 0]
        on_BxGxK = self.ids_BxGxK == draft_BxG[..., None]
        return jnp.sum(jnp.where(on_BxGxK, self.probs_BxGxK, 0.0), axis=-1)

    def residual(self, p_BxV, i_B):
        """max(p - q_i, 0) for each row's draft position i_B; q is zero at i = G (the bonus)."""
        B, G = self.probs_BxGxK.shape[:2]
        rows_B, at_B = jnp.arange(B), jnp.minimum(i_B, G - 1)
        q_BxK = jnp.where((i_B < G)[:, None], self.probs_BxGxK[rows_B, at_B], 0.0)
        if self.ids_BxGxK is None:
            return jnp.maximum(p_BxV - q_BxK, 0.0)
        ids_BxK = self.ids_BxGxK[rows_B, at_B]
        return jnp.maximum(p_BxV.at[rows_B[:, None], ids_BxK].add(-q_BxK), 0.0)
