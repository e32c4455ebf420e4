"""Temperature, top-k and top-p, applied the same way to target and drafter distributions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling settings; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

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
