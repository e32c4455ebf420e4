"""The cost model against hand-computed values, and `jaxspec plan` end to end on a tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.decoding import profile as prof
from jaxspec.checkpoints import store
from jaxspec.decoding import plan as P
from jaxspec.models.params import init_params


def test_expected_tokens_by_hand():
    assert P.expected_tokens(0.5, 3) == pytest.approx((1 - 0.5 ** 4) / (1 - 0.5))  # 1.875
    assert P.expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert P.expected_tokens([0.9, 0.5, 0.2], 2) == pytest.approx(2.35)
    assert P.expected_tokens(0.7, 0) == 1.0


def test_per_position_acceptance_counts_accept_lengths():
    # Accepted drafts per step: 0, 1, 3, 2, 0 -> a1 = 3/5, a2 = 2/3, a3 = 1/2.
    a = P.per_position_acceptance([[1, 2, 4], [3, 1]], 3)
    np.testing.assert_allclose(a, [3 / 5, 2 / 3, 1 / 2])
    np.testing.assert_allclose(P.per_position_acceptance([[1, 1]], 2), [0, 0])


def test_position_counts_follow_each_steps_draft_length():
    # (gained, drafted): (1, 0) reaches nothing; (3, 2) reaches and accepts 1-2; (2, 4) reaches
    # 1-2 and accepts 1; (5, 4) reaches and accepts 1-4.
    accepted, reached = P.position_counts([[1, 3, 2], [5]], [[0, 2, 4], [4]], 4)
    np.testing.assert_array_equal(accepted, [3, 2, 1, 1])
    np.testing.assert_array_equal(reached, [3, 3, 1, 1])


def test_acceptance_memory_starts_rows_at_the_remembered_rates():
    m = P.AcceptanceMemory(weight=4.0, cap=10.0)
    np.testing.assert_array_equal(m.prior("head", 5), np.zeros((2, 5)))
    m.update("head", [[1, 3, 2], [5]], [[0, 2, 4], [4]], 5)
    # Rates 3/3, 2/3, 1/1, 1/1 as 4 tries each; position 5 was never reached: no prior.
    np.testing.assert_allclose(m.prior("head", 5), [[4, 8 / 3, 4, 4, 0], [4, 4, 4, 4, 0]],
                               rtol=1e-6)
    np.testing.assert_array_equal(m.prior("other", 5), np.zeros((2, 5)))
    for _ in range(5):  # 3 misses each: past the cap of 10 reached first drafts, the counts
        m.update("head", [[1, 1, 1]], [[1, 1, 1]], 5)  # scale down, older ones again each time
    accepted, reached = m._counts["head"]
    assert reached[0] == pytest.approx(10.0)
    assert accepted[0] == pytest.approx(3 * 10 / 12 * 10 / 13 * 10 / 13)
    m.clear()
    np.testing.assert_array_equal(m.prior("head", 5), np.zeros((2, 5)))


def test_costs_interpolate_between_measured_sizes():
    costs = {"1": 1.0, "2": 1.2, "4": 1.6}
    assert P.relative_cost(costs, 3) == pytest.approx(1.4)
    assert P.step_cost(2, costs, 0.1) == pytest.approx(0.2 + 1.4)
    assert P.step_cost(0, costs, 0.1) == 1.0
    with pytest.raises(ValueError, match="5 positions"):
        P.relative_cost(costs, 5)


def test_plan_picks_the_best_gamma_or_none():
    p = P.plan(0.8, [1.0] * 5, range(5))
    assert p.speedups[3] == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert p.best_gamma == 4
    steep = {"1": 1.0, "2": 1.6, "4": 2.0}
    p = P.plan(0.2, [P.step_cost(g, steep, 0.05) for g in range(4)], range(4))
    assert p.speedups[0] == 1.0 and p.best_gamma == 0
    assert p.speedups[1] == pytest.approx(1.2 / 1.65)
    assert "no gamma pays" in p.describe()


CFG = jaxspec.ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=512)


def test_plan_drafter_measures_acceptance_of_a_perfect_drafter(tmp_path, monkeypatch):
    """The target drafting for itself is always accepted: a_i = 1, and the plan says which
    gamma pays from the measured costs."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prof, "bandwidth_gbs", lambda: 10.0)
    model = jaxspec.Model(CFG, init_params(CFG, jax.random.key(0), std=0.5), None, "tiny")
    p = prof.plan_drafter(model, "tiny", jaxspec.model_drafter(model), "self", [[1, 2, 3]],
                          gamma_max=3, max_new_tokens=12)  # 3 steps of 4 tokens
    assert p.accept_G == [1.0, 1.0, 1.0] and list(p.speedups) == [0, 1, 2, 3]
    store.save(tmp_path / "m", model.params, model.config)
    with pytest.raises(SystemExit, match="give --drafter"):
        cli.main(["plan", "--model", str(tmp_path / "m")])


def test_gamma_is_chosen_from_acceptance_per_position():
    """A row that accepted its first draft 16 times in 20 but its second never in 16: per
    position a1 = 16.5/22 = 0.75, a2 = (0 + 2 * 0.75)/18; one draft pays most (1.75/1.1 = 1.591
    against (1.75 + 0.75 * 1.5/18)/1.2 = 1.51), though one rate for both (16.5/38) picks two.
    A position never reached takes the rate of the one before it: after 50 hits in 50 at the
    first draft, the row drafts the longest."""
    costs = (1.0, 1.1, 1.2)
    pick = P.choose_gamma(np.array([[16.0, 0.0], [0.0, 0.0]]),
                          np.array([[20.0, 16.0], [0.0, 0.0]]), costs)
    assert pick.tolist() == [1, 1]  # the prior alone: 1.25/1.1 > 1.3125/1.2 > 1
    a = 16.5 / 38
    assert (1 + a + a * a) / 1.2 > (1 + a) / 1.1  # what a single rate would have picked
    costs = (1.0, 1.01, 1.1, 1.11, 1.2)
    assert P.choose_gamma(np.array([[50.0, 0, 0, 0]]), np.array([[50.0, 0, 0, 0]]),
                          costs).tolist() == [4]
    assert P.choose_gamma(np.zeros((1, 4)), np.full((1, 4), 50.0), costs).tolist() == [0]


def test_a_longer_draft_needs_the_margin():
    """Of two lengths whose gains lie within MARGIN, the shorter is drafted: with a head's
    recorded acceptance (0.30, 0.18, 0.07, 0.05) and Gemma 3's loop costs, gamma 1 gains 1.208
    plain steps' worth and gamma 2 1.195; with no margin a cost measured 5% off picks longer."""
    costs = np.array([1.0, 1.076, 1.133, 1.183, 1.276])
    counts = P.start_counts(None, (0.30, 0.18, 0.07, 0.05), 4)[:, None]
    signs = np.array(np.meshgrid(*[[-1, 1]] * 4)).reshape(4, -1).T
    perturbed = [np.concatenate([[1.0], costs[1:] * (1 + 0.05 * s)]) for s in signs]
    assert {int(P.choose_gamma(*counts, c)[0]) for c in perturbed} == {1}
    assert len({int(P.choose_gamma(*counts, c, margin=0.0)[0]) for c in perturbed}) > 1


def test_start_counts_take_memory_over_the_tuned_acceptance():
    tuned = P.start_counts(None, (0.5, 0.25), 3)
    np.testing.assert_allclose(tuned, [[4, 2, 0], [8, 8, 0]])
    remembered = np.array([[1.0, 0, 0], [4.0, 0, 0]], np.float32)
    np.testing.assert_allclose(P.start_counts(remembered, (0.5, 0.25), 3),
                               [[1, 2, 0], [4, 8, 0]])
    np.testing.assert_allclose(P.start_counts(None, None, 2), np.zeros((2, 2)))


def test_acceptance_counts_per_position_follow_each_step(target):
    """track: a step drafting gamma and accepting n reached drafts 1..min(n + 1, gamma) and
    accepted 1..n; counts decay by the memory each step."""
    from jaxspec.decoding import speculative as S

    B = 4
    state = S.prefill(target.params, target.config, None, jnp.ones((B, 16), jnp.int32),
                      jnp.full((B,), 3), jnp.full((B,), 8), jax.random.key(0),
                      prior_2xG=jnp.zeros((2, 3)))
    gamma_B, n_B = jnp.array([0, 2, 3, 3]), jnp.array([0, 2, 1, 3])
    state = S.track(state, gamma_B, n_B)
    np.testing.assert_array_equal(state.accepted_BxG, [[0, 0, 0], [1, 1, 0], [1, 0, 0],
                                                       [1, 1, 1]])
    np.testing.assert_array_equal(state.tried_BxG, [[0, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]])
    state = S.track(state, jnp.array([1, 1, 1, 1]), jnp.array([1, 0, 0, 1]))
    m = S._MEMORY
    np.testing.assert_allclose(state.accepted_BxG[:, 0], [1, m, m, m + 1])
    np.testing.assert_allclose(state.tried_BxG[:, :2], [[1, 0], [m + 1, m], [m + 1, m],
                                                        [m + 1, m]])
