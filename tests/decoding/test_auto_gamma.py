"""gamma="auto": each row picks its draft length every step from its acceptance so far and the
cost model. Greedy output stays identical; a useless drafter falls back to plain steps; a perfect
one drafts the most it may. (Sampling exactness: test_sampling_exact.py.)"""

import numpy as np
import pytest

import jaxspec
from jaxspec.errors import UserError

FLAT = (1.0, 1.05, 1.1, 1.15, 1.2)  # verification nearly free (bfloat16 on CPU)
STEEP = (1.0, 1.6, 2.0, 2.4, 2.8)  # the float32 GEMM jump, plus a costly drafter
PROMPTS = [[1, 5, 2, 7, 1, 5, 2], [3, 3, 9], [4, 8, 15, 16, 23, 42, 4, 8, 15]]


@pytest.fixture(scope="module")
def plain(target):
    return jaxspec.generate(target, PROMPTS, max_new_tokens=[24, 17, 30])


@pytest.mark.parametrize("costs", [FLAT, STEEP], ids=["flat", "steep"])
@pytest.mark.parametrize("kind", ["near", "far", "ngram"])
def test_greedy_output_is_identical(target, near_model, far_model, plain, kind, costs):
    drafter = {"near": near_model, "far": far_model, "ngram": jaxspec.ngram_drafter(2)}[kind]
    res = jaxspec.speculative_generate(target, drafter, PROMPTS, gamma="auto", gamma_max=4,
                                       costs=costs, max_new_tokens=[24, 17, 30])
    assert res.token_ids == plain.token_ids
    for gains, drafted in zip(res.accept_lengths, res.draft_lengths):
        assert len(gains) == len(drafted)
        assert all(0 <= d <= 4 and 1 <= a <= d + 1 for a, d in zip(gains, drafted))


def test_a_useless_drafter_falls_back_to_plain_steps(target, far_model, plain):
    """The far drafter rarely agrees: under steep costs rows stop drafting, so the target runs
    about as many forward passes as plain decoding, and most of them draft nothing."""
    res = jaxspec.speculative_generate(target, far_model, PROMPTS, gamma="auto", gamma_max=4,
                                       costs=STEEP, max_new_tokens=[24, 17, 30])
    steps = sum(len(a) for a in res.accept_lengths)
    assert steps <= 1.05 * plain.num_new_tokens
    assert np.mean([d for row in res.draft_lengths for d in row]) < 0.5


def test_a_useless_drafter_costs_little_even_when_drafting_is_nearly_free(target, far_model):
    """Under flat costs a draft pays from 5% acceptance: a row needs about 10 misses to stop,
    then only probes now and then (a probe costs 5-10% of a step), so the run's time under the
    cost model stays within 5% of plain decoding's."""
    budgets = [60, 50, 70]
    plain = jaxspec.generate(target, PROMPTS, max_new_tokens=budgets)
    res = jaxspec.speculative_generate(target, far_model, PROMPTS, gamma="auto", gamma_max=4,
                                       costs=FLAT, max_new_tokens=budgets)
    assert res.token_ids == plain.token_ids and res.acceptance_rate < 0.05
    modelled = sum(FLAT[d] for row in res.draft_lengths for d in row)
    assert modelled <= 1.05 * plain.num_new_tokens
    assert np.mean([d == 0 for row in res.draft_lengths for d in row[20:]]) > 0.5


def test_a_drafter_the_prior_never_picks_is_not_run(target, far_model, plain, monkeypatch):
    """Under steep costs the prior acceptance (1/4) picks no draft, and only drafting would
    move it: the call decodes without the drafter (no drafter prefill, exactly plain steps)."""
    import jax

    from jaxspec.decoding import runner
    from jaxspec.drafters import model as drafters

    def refuse(*a, **kw):
        raise AssertionError("the drafter ran")

    monkeypatch.setattr(drafters.ModelSpec, "init", refuse)
    monkeypatch.setenv("JAXSPEC_COMPILATION_CACHE", "0")  # nor read them back from disk
    runner.DECODER.clear()  # earlier tests compiled these calls: trace them again
    jax.clear_caches()
    res = jaxspec.speculative_generate(target, far_model, PROMPTS, gamma="auto", gamma_max=4,
                                       costs=STEEP, max_new_tokens=[24, 17, 30])
    assert res.token_ids == plain.token_ids
    assert res.accept_lengths == plain.accept_lengths and res.acceptance_rate == 0.0
    with pytest.raises(AssertionError, match="the drafter ran"):
        jaxspec.speculative_generate(target, far_model, PROMPTS, gamma="auto", gamma_max=4,
                                     costs=FLAT, max_new_tokens=3)


def test_a_call_starts_from_what_earlier_calls_measured(target, far_model, plain):
    """The second call with a useless drafter starts at its remembered acceptance, not the
    prior, so it probes less; remember=False starts from the prior and changes nothing."""
    from jaxspec.decoding import runner

    kw = dict(gamma="auto", gamma_max=4, costs=FLAT, max_new_tokens=[24, 17, 30])
    drafts = lambda r: sum(d > 0 for row in r.draft_lengths for d in row)
    counts = lambda: {k: [c.tolist() for c in v]
                      for k, v in runner.DECODER.acceptance._counts.items()}
    cold = jaxspec.speculative_generate(target, far_model, PROMPTS, remember=False, **kw)
    assert counts() == {}
    first = jaxspec.speculative_generate(target, far_model, PROMPTS, **kw)
    second = jaxspec.speculative_generate(target, far_model, PROMPTS, **kw)
    before = counts()
    again_cold = jaxspec.speculative_generate(target, far_model, PROMPTS, remember=False, **kw)
    assert counts() == before != {}
    assert first.draft_lengths == cold.draft_lengths == again_cold.draft_lengths
    assert drafts(second) < drafts(first)
    assert second.token_ids == plain.token_ids


def test_ngram_rows_without_a_match_take_plain_steps(target, plain):
    """Where the text's last token never occurred before, prompt lookup has nothing to propose
    and gamma "auto" does not verify its filler: those steps draft 0 tokens."""
    res = jaxspec.speculative_generate(target, jaxspec.ngram_drafter(2), PROMPTS, gamma="auto",
                                       gamma_max=4, costs=FLAT, max_new_tokens=[24, 17, 30])
    assert res.token_ids == plain.token_ids
    unmatched = matched = 0
    for prompt, new, gains, drafted in zip(PROMPTS, res.token_ids, res.accept_lengths,
                                           res.draft_lengths):
        text, end = list(prompt) + new, len(prompt)
        for gained, d in zip(gains, drafted):
            if text[end - 1] not in text[:end - 1]:
                assert d == 0
                unmatched += 1
            else:
                matched += d > 0
            end += gained
    assert unmatched and matched


def test_a_perfect_drafter_reaches_the_longest_draft(target):
    res = jaxspec.speculative_generate(target, target, PROMPTS, gamma="auto", gamma_max=4,
                                       costs=FLAT, max_new_tokens=40)
    for drafted, gains in zip(res.draft_lengths, res.accept_lengths):
        assert drafted[-3:-1] == [4, 4]  # the last step may be cut by the budget
        assert all(a == d + 1 for a, d in zip(gains[:-1], drafted[:-1]))


def test_costs_default_to_the_measured_profile(target, near_model, plain, tmp_path,
                                               monkeypatch):
    from jaxspec.decoding import profile

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(profile, "bandwidth_gbs", lambda: 10.0)
    res = jaxspec.speculative_generate(target, near_model, PROMPTS, gamma="auto", gamma_max=2,
                                       max_new_tokens=[24, 17, 30])
    assert res.token_ids == plain.token_ids
    assert len(list((tmp_path / "profile").glob("*/loop-*.json"))) == 1


@pytest.mark.parametrize("kw,match", [(dict(gamma="fast"), "int or 'auto'"),
                                      (dict(gamma="auto", costs=(1.0, 1.2)), "3 positive"),
                                      (dict(gamma="auto", costs=(1.0, 0.0, 1.2)), "3 positive")])
def test_bad_auto_settings_are_user_errors(target, kw, match):
    with pytest.raises(UserError, match=match):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(2), [[1, 2]], gamma_max=2,
                                     max_new_tokens=3, **kw)


LOOP = np.array([1.0, 1.076, 1.133, 1.183, 1.276])  # Gemma 3 bf16 with an EAGLE head, measured


def test_draft_lengths_hold_when_the_plain_step_is_measured_5_percent_off(target, near_model):
    """Step costs are measured against a plain step, which a busy machine slows or speeds
    by a few percent from run to run: every row drafts the same lengths whether the measured
    costs are right or all 5% higher or lower."""
    kw = dict(gamma="auto", gamma_max=4, max_new_tokens=[24, 17, 30], remember=False)
    runs = [jaxspec.speculative_generate(target, near_model, PROMPTS, costs=np.r_[
        1.0, LOOP[1:] * f], **kw).draft_lengths for f in (1.0, 1.05, 0.95)]
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert len({d for row in runs[0] for d in row}) > 2  # lengths vary along the rows
