"""Lookahead decoding (drafters/lookahead.py): the window as a token tree, one Jacobi iteration
with its n-grams, greedy output equal to `generate`'s where its n-grams are accepted (a one-layer
target with its attention output zeroed maps each token to the next on its own, so the column
trajectories of the window are true n-grams of its text), sampled output with the target's
exact joint distribution, and clear errors."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding.sampling import Sampling
from jaxspec.drafters.base import DraftInput
from jaxspec.drafters.lookahead import LookaheadSpec
from jaxspec.errors import UserError
from jaxspec.loading import parse_drafter

PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1], [60, 2, 33]]
MAX_NEW = [23, 31, 9, 17]


def test_the_window_is_a_tree_of_trajectories():
    """Level l of column i sits at depth i + l + 1 and sees level 0 up to its column and its own
    column below it; each candidate is a chain of N - 1 under the root."""
    s = LookaheadSpec(window=3, ngram=3, candidates=2)
    t, (win_AxY, cand_WxA) = s.tree, s._nodes
    assert t.size == (3 + 2) * 2
    for lv in range(2):
        for i in range(3):
            k = win_AxY[lv, i] + 1
            assert t.depth_N1[k] == i + lv + 1
            seen = {int(j) - 1 for j in np.flatnonzero(t.ancestors_N1xN1[k]) if j}
            assert seen == {int(win_AxY[0, c]) for c in range(i + 1)} | {
                int(win_AxY[m, i]) for m in range(lv + 1)}
    assert [list(t.depth_N1[cand_WxA[g] + 1]) for g in range(2)] == [[1, 2], [1, 2]]


def test_one_jacobi_iteration_pools_each_column_once():
    """The target's token after each column's top level becomes its new top level, the levels
    move down, and each column's trajectory with it enters the pool once."""
    s = LookaheadSpec(window=2, ngram=3, candidates=1, pool=4)
    V = 10
    inp = DraftInput(jnp.asarray([[4, 5, 6, 7]]), jnp.asarray([4]), jnp.zeros((1, 4, 0)), V)
    state = s.init({}, inp)
    assert state["window_BxAxY"].tolist() == [[[7, 6], [6, 5]]]
    win_AxY, _ = s._nodes
    logits = jnp.zeros((1, s.tree.size + 1, V))
    logits = logits.at[0, win_AxY[1, 0] + 1, 8].set(1.0).at[0, win_AxY[1, 1] + 1, 9].set(1.0)
    state = {**state, "steps_B": jnp.asarray([1])}
    new = s.observe({}, state, logits)
    assert new["window_BxAxY"].tolist() == [[[6, 5], [8, 9]]]
    pooled = {tuple(g) for g, a in zip(new["pool_BxExA1"][0].tolist(), new["age_BxE"][0])
              if a >= 0}
    assert pooled == {(7, 6, 8), (6, 5, 9)}
    again = s.observe({}, {**state, "pool_BxExA1": new["pool_BxExA1"], "age_BxE": new["age_BxE"]},
                      logits)
    assert int((again["age_BxE"][0] >= 0).sum()) == 2  # known n-grams are not pooled twice
    draft = s.propose({}, new, inp, None, Sampling(), s.tree).tokens_BxN
    _, cand_WxA = s._nodes
    assert draft[0, cand_WxA[0]].tolist() == [6, 8]  # the pooled n-gram after the last token, 7


@pytest.fixture(scope="module")
def cycling(tiny):
    t = tiny.model(tiny.config(num_layers=1), 0, "cycling")
    layer = {**t.params["layers"][0], "wo": jnp.zeros_like(t.params["layers"][0]["wo"])}
    return jaxspec.Model(t.config, {**t.params, "layers": [layer]}, None, "cycling")


@pytest.mark.parametrize("rows", [[0], [0, 1, 2, 3]], ids=["batch1", "ragged4"])
def test_greedy_output_equals_generate_and_its_ngrams_are_accepted(cycling, target, rows):
    prompts, max_new = [PROMPTS[r] for r in rows], [MAX_NEW[r] for r in rows]
    drafter = jaxspec.lookahead_drafter(5, 4, 5)
    for model, min_tau in ((cycling, 1.3), (target, 1.0)):
        ref = jaxspec.generate(model, prompts, max_new).token_ids
        res = jaxspec.speculative_generate(model, drafter, prompts, max_new_tokens=max_new)
        assert res.token_ids == ref
        assert res.tau >= min_tau, (model.name, res.tau)


def test_sampling_matches_target_distribution(small_target, exact):
    """Two tokens from PROMPT: the first step verifies the window's guesses (the prompt's last
    tokens), the second may verify a pooled n-gram too."""
    s = Sampling(1.0)
    joint, _ = exact.exact_joint(small_target, s)
    got = exact.empirical_joint(small_target, jaxspec.lookahead_drafter(2, 2, 2), s, None)
    assert exact.tv(got, joint) < exact.TV_BOUND
    res = jaxspec.speculative_generate(small_target, jaxspec.lookahead_drafter(2, 2, 2),
                                       [exact.PROMPT] * 256, max_new_tokens=2, temperature=1.0)
    assert any(g == [2] for g in res.accept_lengths)  # drafts were accepted: the test can fail


def test_errors(cycling, target):
    la = jaxspec.lookahead_drafter()
    for shape, msg in [(dict(gamma=3), "its own tree"), (dict(gamma="auto"), "fixed shape"),
                       (dict(tree=[(0,), (1,)]), "its own tree")]:
        with pytest.raises(UserError, match=msg):
            jaxspec.speculative_generate(cycling, la, [[1, 2, 3]], max_new_tokens=4, **shape)
    with pytest.raises(UserError, match="ngram >= 2"):
        jaxspec.lookahead_drafter(4, 1, 2)
    with pytest.raises(UserError, match="lookahead"):
        parse_drafter("lookahead:4:x", target)
    d = parse_drafter("lookahead:4:3:2", target)
    assert (d.spec.window, d.spec.ngram, d.spec.candidates) == (4, 3, 2)
