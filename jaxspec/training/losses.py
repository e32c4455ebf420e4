"""Losses for training a drafter (student) on a target model (teacher).

Every loss takes logits shaped [batch, seq, vocab] (any float dtype; computed in
float32, or float64 if given float64) and a mask over [batch, seq] selecting the
positions that count. Each returns the masked sum of per-position losses divided
by max(#masked, 1).
"""

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from jaxspec.errors import UserError

LossFn = Callable[[jax.Array, Mapping[str, jax.Array]], jax.Array]

_STD_EPS = 1e-6


def _masked_mean(values_BxS: jax.Array, mask_BxS: jax.Array) -> jax.Array:
    """Sum of `values_BxS` over masked positions divided by max(count, 1)."""
    mask_BxS = mask_BxS.astype(bool)
    total = jnp.sum(jnp.where(mask_BxS, values_BxS, 0.0))
    count = jnp.sum(mask_BxS.astype(jnp.float32))
    return total / jnp.maximum(count, 1.0)


def _upcast(x: jax.Array) -> jax.Array:
    """Casts to at least float32 (bf16 -> f32, f64 kept)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _student_teacher_probs(
    student_logits_BxSxV: jax.Array, teacher_logits_BxSxV: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Softmax (at least float32) of the student and of the constant teacher."""
    q_BxSxV = jax.nn.softmax(_upcast(student_logits_BxSxV), axis=-1)
    teacher_logits_BxSxV = jax.lax.stop_gradient(teacher_logits_BxSxV)
    p_BxSxV = jax.nn.softmax(_upcast(teacher_logits_BxSxV), axis=-1)
    return q_BxSxV, p_BxSxV


def cross_entropy(
    logits_BxSxV: jax.Array, targets_BxS: jax.Array, mask_BxS: jax.Array
) -> jax.Array:
    """Masked mean next-token cross-entropy; targets are already shifted.

    Targets at masked-out positions may hold any value (e.g. -100 padding).
    """
    safe_targets_BxS = jnp.where(mask_BxS.astype(bool), targets_BxS, 0)
    ce_BxS = optax.softmax_cross_entropy_with_integer_labels(
        _upcast(logits_BxSxV), safe_targets_BxS
    )
    return _masked_mean(ce_BxS, mask_BxS)


def forward_kl(
    student_logits_BxSxV: jax.Array,
    teacher_logits_BxSxV: jax.Array,
    mask_BxS: jax.Array,
    temperature: float = 1.0,
) -> jax.Array:
    """Masked mean of KL(p_teacher || q_student) with both logits divided by
    `temperature`; the teacher is a constant (stop_gradient)."""
    teacher_logits_BxSxV = jax.lax.stop_gradient(teacher_logits_BxSxV)
    log_q_BxSxV = jax.nn.log_softmax(
        _upcast(student_logits_BxSxV) / temperature, axis=-1
    )
    log_p_BxSxV = jax.nn.log_softmax(
        _upcast(teacher_logits_BxSxV) / temperature, axis=-1
    )
    p_BxSxV = jnp.exp(log_p_BxSxV)
    terms_BxSxV = jnp.where(p_BxSxV > 0, p_BxSxV * (log_p_BxSxV - log_q_BxSxV), 0.0)
    return _masked_mean(jnp.sum(terms_BxSxV, axis=-1), mask_BxS)


def total_variation(
    student_logits_BxSxV: jax.Array,
    teacher_logits_BxSxV: jax.Array,
    mask_BxS: jax.Array,
) -> jax.Array:
    """Masked mean of the exact TVD(p, q) = 1/2 sum_x |p(x) - q(x)|.

    Its gradient w.r.t. the student is -E_{x~q}[1{q(x) < p(x)} grad log q(x)]
    (teacher constant).
    """
    q_BxSxV, p_BxSxV = _student_teacher_probs(student_logits_BxSxV, teacher_logits_BxSxV)
    tvd_BxS = 0.5 * jnp.sum(jnp.abs(p_BxSxV - q_BxSxV), axis=-1)
    return _masked_mean(tvd_BxS, mask_BxS)


def tvd_plus_plus(
    student_logits_BxSxV: jax.Array,
    teacher_logits_BxSxV: jax.Array,
    mask_BxS: jax.Array,
) -> jax.Array:
    """TVD++ surrogate loss (Goel et al. 2024, "Direct Alignment of Draft Model
    for Speculative Decoding with Chat-Fine-Tuned LLMs", arXiv:2403.00858).

    With teacher p, student q and N masked positions t, the TVD gradient is the
    policy gradient -E_{x~q}[r(x) grad log q(x)] with reward
    r_t(x) = 1{q_t(x) < p_t(x)}. TVD++ normalises the reward over the batch:
    r~_t(x) = (r_t(x) - mu) / (sigma + 1e-6), where
    mu = 1/N sum_t sum_x q_t(x) r_t(x) and
    sigma^2 = 1/N sum_t sum_x q_t(x) (r_t(x) - mu)^2
    are the expected batch mean/variance of rewards of tokens x ~ q_t.
    The expectation is taken exactly over the vocabulary instead of sampled:

        loss = -1/N sum_t sum_x sg(q_t(x) r~_t(x)) log q_t(x)
        grad = -1/N sum_t sum_x q_t(x) r~_t(x) grad log q_t(x)

    (sg = stop_gradient; mu, sigma, r are constants). Because the exact sum
    makes the baseline mu vanish, grad == grad(total_variation) / (sigma + 1e-6),
    i.e. the TVD gradient rescaled per batch. Only the gradient is meaningful;
    log `total_variation` to monitor training.
    """
    mask_BxS = mask_BxS.astype(bool)
    q_BxSxV, p_BxSxV = _student_teacher_probs(student_logits_BxSxV, teacher_logits_BxSxV)
    log_q_BxSxV = jax.nn.log_softmax(_upcast(student_logits_BxSxV), axis=-1)
    q_const_BxSxV = jax.lax.stop_gradient(q_BxSxV)
    reward_BxSxV = (q_const_BxSxV < p_BxSxV).astype(q_const_BxSxV.dtype)
    mean_reward = _masked_mean(jnp.sum(q_const_BxSxV * reward_BxSxV, axis=-1), mask_BxS)
    var_reward = _masked_mean(
        jnp.sum(q_const_BxSxV * (reward_BxSxV - mean_reward) ** 2, axis=-1), mask_BxS
    )
    norm_reward_BxSxV = (reward_BxSxV - mean_reward) / (jnp.sqrt(var_reward) + _STD_EPS)
    weighted_BxS = jnp.sum(q_const_BxSxV * norm_reward_BxSxV * log_q_BxSxV, axis=-1)
    return -_masked_mean(weighted_BxS, mask_BxS)


def loss_fn_by_name(name: str) -> LossFn:
    """Loss `(student_logits, batch) -> scalar` for "ce", "kl" or "tvdpp".

    `batch` holds "targets" and "mask", plus "teacher_logits" for kl/tvdpp.
    """
    losses: dict[str, LossFn] = {
        "ce": lambda logits, batch: cross_entropy(logits, batch["targets"], batch["mask"]),
        "kl": lambda logits, batch: forward_kl(logits, batch["teacher_logits"], batch["mask"]),
        "tvdpp": lambda logits, batch: tvd_plus_plus(
            logits, batch["teacher_logits"], batch["mask"]
        ),
    }
    if name not in losses:
        raise UserError(f"Unknown loss {name!r}; valid names: {sorted(losses)}")
    return losses[name]
