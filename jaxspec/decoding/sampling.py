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


def pick(key, logits_xV, s: Sampling):
    """(token ids [...], distribution [..., V] or None when greedy)."""
    if s.greedy:
        return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32), None
    p = probs(logits_xV, s)
    return jax.random.categorical(key, jnp.log(p), axis=-1).astype(jnp.int32), p


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
