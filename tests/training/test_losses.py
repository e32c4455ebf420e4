"""Tests for jaxspec.training.losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.training import losses

# Tiny example: batch 1, seq 2, vocab 3. Logits are log-probabilities plus an
# arbitrary shift (softmax is shift invariant).
STUDENT_P = np.array([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]])
TEACHER_P = np.array([[[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]]])
STUDENT_LOGITS = jnp.asarray(np.log(STUDENT_P) + 1.5, jnp.float32)
TEACHER_LOGITS = jnp.asarray(np.log(TEACHER_P) - 0.7, jnp.float32)
TARGETS = jnp.array([[0, 2]])
FULL_MASK = jnp.array([[1.0, 1.0]])

DISTILL_LOSSES = [losses.forward_kl, losses.total_variation, losses.tvd_plus_plus]


def all_losses(student_logits, teacher_logits, targets, mask):
    """Every loss on the same inputs, keyed by name."""
    return {
        "ce": losses.cross_entropy(student_logits, targets, mask),
        "kl": losses.forward_kl(student_logits, teacher_logits, mask),
        "tv": losses.total_variation(student_logits, teacher_logits, mask),
        "tvdpp": losses.tvd_plus_plus(student_logits, teacher_logits, mask),
    }


@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def central_difference_grad(f, x, eps=1e-6):
    """Central finite-difference gradient of scalar f at float64 array x."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[idx] = eps
        grad[idx] = (float(f(x + step)) - float(f(x - step))) / (2 * eps)
    return grad


def np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_cross_entropy_hand_value():
    # (-ln 0.5 - ln 0.3) / 2
    value = losses.cross_entropy(STUDENT_LOGITS, TARGETS, FULL_MASK)
    np.testing.assert_allclose(value, 0.9485599924429406, rtol=1e-6)


def test_forward_kl_hand_value():
    # pos 0: 0.2 ln(0.2/0.5) + 0.2 ln(0.2/0.3) + 0.6 ln(0.6/0.2) = 0.39481621
    # pos 1: 0.3 ln(0.3/0.1) + 0.3 ln(0.3/0.6) + 0.4 ln(0.4/0.3) = 0.23671236
    value = losses.forward_kl(STUDENT_LOGITS, TEACHER_LOGITS, FULL_MASK)
    np.testing.assert_allclose(value, 0.31576428330878176, rtol=1e-6)
    # T=2: p ∝ sqrt(teacher probs), q ∝ sqrt(student probs), KL averaged.
    value_t2 = losses.forward_kl(STUDENT_LOGITS, TEACHER_LOGITS, FULL_MASK, temperature=2.0)
    np.testing.assert_allclose(value_t2, 0.08062914644891903, rtol=1e-5)


def test_total_variation_hand_value():
    # pos 0: (0.3 + 0.1 + 0.4) / 2 = 0.4; pos 1: (0.2 + 0.3 + 0.1) / 2 = 0.3
    value = losses.total_variation(STUDENT_LOGITS, TEACHER_LOGITS, FULL_MASK)
    np.testing.assert_allclose(value, 0.35, rtol=1e-6)


def test_tvd_plus_plus_hand_value():
    # r = 1{q < p}: pos 0 -> [0, 0, 1], pos 1 -> [1, 0, 1].
    # mu = (0.2 + 0.4) / 2 = 0.3, sigma^2 = mu (1 - mu) = 0.21.
    # loss = -1/2 sum_t sum_x q (r - 0.3) / sqrt(0.21) ln q
    #      = -1/2 (-0.0129914 - 0.3220660) / 0.4582576 = 0.3655786
    value = losses.tvd_plus_plus(STUDENT_LOGITS, TEACHER_LOGITS, FULL_MASK)
    np.testing.assert_allclose(value, 0.36557858910700236, rtol=1e-5)


def test_masked_positions_do_not_change_losses():
    mask = jnp.array([[1.0, 0.0]])
    garbage = jax.random.normal(jax.random.PRNGKey(0), (2, 3)) * 10.0
    student2 = STUDENT_LOGITS.at[0, 1].set(garbage[0])
    teacher2 = TEACHER_LOGITS.at[0, 1].set(garbage[1])
    targets2 = TARGETS.at[0, 1].set(-100)

    base = all_losses(STUDENT_LOGITS, TEACHER_LOGITS, TARGETS, mask)
    changed = all_losses(student2, teacher2, targets2, mask)
    for name in base:
        np.testing.assert_allclose(changed[name], base[name], rtol=1e-6, err_msg=name)
    # Only position 0 counts: -ln 0.5, KL and TV of position 0.
    np.testing.assert_allclose(base["ce"], 0.6931471805599453, rtol=1e-6)
    np.testing.assert_allclose(base["kl"], 0.39481620520440186, rtol=1e-6)
    np.testing.assert_allclose(base["tv"], 0.4, rtol=1e-6)
    # A bool mask is accepted and means the same.
    bool_losses = all_losses(STUDENT_LOGITS, TEACHER_LOGITS, TARGETS, mask.astype(bool))
    for name in base:
        np.testing.assert_allclose(bool_losses[name], base[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("loss", DISTILL_LOSSES)
def test_masked_positions_get_zero_gradient(loss):
    mask = jnp.array([[0.0, 1.0]])
    grad = jax.grad(loss)(STUDENT_LOGITS, TEACHER_LOGITS, mask)
    np.testing.assert_array_equal(grad[0, 0], np.zeros(3))
    assert np.any(np.abs(grad[0, 1]) > 1e-3)


def test_all_zero_mask_gives_zero_without_nan():
    mask = jnp.zeros((1, 2))
    for name, value in all_losses(STUDENT_LOGITS, TEACHER_LOGITS, TARGETS, mask).items():
        assert float(value) == 0.0, name
    grads = [jax.grad(loss)(STUDENT_LOGITS, TEACHER_LOGITS, mask) for loss in DISTILL_LOSSES]
    grads.append(jax.grad(losses.cross_entropy)(STUDENT_LOGITS, TARGETS, mask))
    for grad in grads:
        np.testing.assert_array_equal(grad, np.zeros_like(grad))


def test_forward_kl_zero_for_identical_and_grads_only_student():
    value = losses.forward_kl(STUDENT_LOGITS, STUDENT_LOGITS + 3.0, FULL_MASK)
    np.testing.assert_allclose(value, 0.0, atol=1e-6)

    grad_student, grad_teacher = jax.grad(losses.forward_kl, argnums=(0, 1))(
        STUDENT_LOGITS, TEACHER_LOGITS, FULL_MASK
    )
    np.testing.assert_array_equal(grad_teacher, np.zeros_like(grad_teacher))
    # d KL / d z = (q - p) / N for the student logits z.
    np.testing.assert_allclose(grad_student, (STUDENT_P - TEACHER_P) / 2, atol=1e-6)


@pytest.mark.parametrize("loss", [losses.total_variation, losses.tvd_plus_plus])
def test_tv_losses_give_no_gradient_to_teacher(loss):
    grad_teacher = jax.grad(loss, argnums=1)(STUDENT_LOGITS, TEACHER_LOGITS, FULL_MASK)
    np.testing.assert_array_equal(grad_teacher, np.zeros_like(grad_teacher))


def random_example(seed, shape=(2, 3, 5)):
    rng = np.random.default_rng(seed)
    student = rng.normal(size=shape)
    teacher = rng.normal(size=shape) * 2.0
    mask = np.ones(shape[:2])
    mask[1, 2] = 0.0
    return student, teacher, mask


def test_total_variation_grad_matches_finite_differences(x64):
    student, teacher, mask = random_example(1)
    f = lambda z: losses.total_variation(jnp.asarray(z), jnp.asarray(teacher), jnp.asarray(mask))
    grad = np.asarray(jax.grad(f)(student))
    assert grad.dtype == np.float64
    np.testing.assert_allclose(grad, central_difference_grad(f, student), atol=1e-8)


def test_tvd_plus_plus_grad_matches_reference_surrogate(x64):
    student, teacher, mask = random_example(2)
    n = mask.sum()

    # Reference TVD++ surrogate: weights q0 * r_norm frozen at student0.
    q0, p = np_softmax(student), np_softmax(teacher)
    reward = (q0 < p).astype(np.float64)
    mu = np.sum(mask[..., None] * q0 * reward) / n
    sigma = np.sqrt(np.sum(mask[..., None] * q0 * (reward - mu) ** 2) / n)
    weights = q0 * (reward - mu) / (sigma + 1e-6)

    def reference(z):
        return -np.sum(mask[..., None] * weights * np_log_softmax(z)) / n

    f = lambda z: losses.tvd_plus_plus(jnp.asarray(z), jnp.asarray(teacher), jnp.asarray(mask))
    np.testing.assert_allclose(f(student), reference(student), rtol=1e-10)
    grad = np.asarray(jax.grad(f)(student))
    np.testing.assert_allclose(grad, central_difference_grad(reference, student), atol=1e-8)

    # With the exact vocabulary sum the baseline cancels: grad = grad TV / sigma.
    tv = lambda z: losses.total_variation(z, jnp.asarray(teacher), jnp.asarray(mask))
    tv_grad = np.asarray(jax.grad(tv)(jnp.asarray(student)))
    np.testing.assert_allclose(grad, tv_grad / (sigma + 1e-6), atol=1e-10)


def test_tvd_plus_plus_step_reduces_total_variation():
    student, teacher, mask = (jnp.asarray(a, jnp.float32) for a in random_example(3))
    initial = losses.total_variation(student, teacher, mask)
    grad = jax.grad(losses.tvd_plus_plus)(student, teacher, mask)
    after_one = losses.total_variation(student - 0.1 * grad, teacher, mask)
    assert after_one < initial

    for _ in range(200):
        student = student - 0.5 * jax.grad(losses.tvd_plus_plus)(student, teacher, mask)
    assert losses.total_variation(student, teacher, mask) < 0.5 * initial


def test_bf16_inputs_give_finite_float32_outputs():
    student = STUDENT_LOGITS.astype(jnp.bfloat16)
    teacher = TEACHER_LOGITS.astype(jnp.bfloat16)
    reference = all_losses(STUDENT_LOGITS, TEACHER_LOGITS, TARGETS, FULL_MASK)
    for name, value in all_losses(student, teacher, TARGETS, FULL_MASK).items():
        assert value.dtype == jnp.float32, name
        assert np.isfinite(float(value)), name
        np.testing.assert_allclose(value, reference[name], rtol=2e-2, err_msg=name)


def test_loss_fn_by_name_dispatches():
    batch = {"targets": TARGETS, "mask": FULL_MASK, "teacher_logits": TEACHER_LOGITS}
    expected = all_losses(STUDENT_LOGITS, TEACHER_LOGITS, TARGETS, FULL_MASK)
    for name in ["ce", "kl", "tvdpp"]:
        value = losses.loss_fn_by_name(name)(STUDENT_LOGITS, batch)
        np.testing.assert_allclose(value, expected[name], rtol=1e-6, err_msg=name)
    ce_only = losses.loss_fn_by_name("ce")(STUDENT_LOGITS, {"targets": TARGETS, "mask": FULL_MASK})
    np.testing.assert_allclose(ce_only, expected["ce"], rtol=1e-6)


def test_loss_fn_by_name_unknown_lists_valid_names():
    with pytest.raises(ValueError, match="ce.*kl.*tvdpp"):
        losses.loss_fn_by_name("mse")
