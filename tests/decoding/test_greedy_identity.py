"""Greedy speculative decoding emits exactly the target's greedy tokens, whatever the drafter.

Every drafter kind (independent model, noisy copy, reduced-vocabulary head, layer skip, n-gram)
and gamma in {1, 3, 5}, on a ragged batch (a 1-token prompt, one past the 16-token prompt
bucket, per-row budgets, a stop token that ends one row while the others run on) and on a single
prompt; a tiny Gemma 3 with sliding-window layers; and SmolLM2-135M-Instruct on chat prompts.
`generate` (the same loop with gamma 0) is the reference, itself checked against the argmax of
`jaxspec.score` over the growing sequence, one token at a time on the host.
"""

from collections import Counter

import numpy as np
import pytest

import jaxspec

PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1], [60, 2, 33]]
MAX_NEW = [23, 31, 9, 17]
KINDS = ["far", "near", "subset", "layer_skip", "ngram"]


def _cut_at(row, stop):
    return row[:row.index(stop) + 1] if stop in row else row


def _check_stats(res, gamma):
    """accept_lengths account for every token, and each step gains 1..gamma+1 tokens."""
    for toks, gains in zip(res.token_ids, res.accept_lengths):
        assert sum(gains) == len(toks)
        assert all(1 <= g <= gamma + 1 for g in gains)
    flat = [g for row in res.accept_lengths for g in row]
    assert res.tau == pytest.approx(sum(flat) / len(flat))
    assert res.acceptance_rate == pytest.approx(sum(g - 1 for g in flat) / (gamma * len(flat)))


@pytest.fixture(scope="module")
def free(target):
    """The target's greedy continuations without a stop token."""
    res = jaxspec.generate(target, PROMPTS, MAX_NEW)
    assert [len(t) for t in res.token_ids] == MAX_NEW
    return res.token_ids


def test_generate_matches_stepwise_argmax(target, free):
    """An independent greedy reference: no decode loop and no KV cache, only full-sequence
    logits. Rows are right-padded to one shape (one compile); causal attention keeps the padding
    out of each row's last position."""
    seqs = [list(p) for p in PROMPTS]
    ends = [len(p) + m for p, m in zip(PROMPTS, MAX_NEW)]
    for _ in range(max(MAX_NEW)):
        padded = np.array([s + [0] * (max(ends) - len(s)) for s in seqs])
        logits_BxSxV = jaxspec.score(target, padded)
        for b, s in enumerate(seqs):
            if len(s) < ends[b]:
                s.append(int(np.argmax(logits_BxSxV[b, len(s) - 1])))
    assert [s[len(p):] for s, p in zip(seqs, PROMPTS)] == free


@pytest.fixture(scope="module")
def reference(target, free, stop):
    res = jaxspec.generate(target, PROMPTS, MAX_NEW, stop=stop)
    expected = [_cut_at(row, stop) for row in free]
    assert res.token_ids == expected
    assert len(res.token_ids[0]) < MAX_NEW[0]  # row 0 stopped early ...
    assert any(len(t) == m for t, m in zip(res.token_ids, MAX_NEW))  # ... others ran to budget
    return res.token_ids


@pytest.fixture(scope="module")
def drafters(tiny, target, far_model, near_model, free):
    # The reduced head covers the target's 12 most frequent greedy tokens plus 4 others, so it
    # agrees with the target often but not always (the target sometimes wants a token it lacks).
    common = [t for t, _ in Counter(t for row in free for t in row).most_common(12)]
    ids = sorted(common + [t for t in range(64) if t not in common][:4])
    return {
        "far": jaxspec.model_drafter(far_model),
        "near": near_model,
        "subset": tiny.subset_head_drafter(target, ids, scale=0.05),
        "layer_skip": jaxspec.layer_skip_drafter(target, [1]),
        "ngram": jaxspec.ngram_drafter(3),
    }


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_ragged_batch_matches_generate(target, drafters, reference, stop, kind, gamma):
    res = jaxspec.speculative_generate(target, drafters[kind], PROMPTS, gamma=gamma,
                                       max_new_tokens=MAX_NEW, stop=stop)
    assert res.token_ids == reference
    _check_stats(res, gamma)


def test_drafters_exercise_both_paths(target, drafters, reference, stop):
    """The near drafter has whole runs accepted (bonus token) and rejections; the far one is
    mostly rejected. Guards the identity tests above against testing only one path."""
    near = jaxspec.speculative_generate(target, drafters["near"], PROMPTS, gamma=3,
                                        max_new_tokens=MAX_NEW, stop=stop)
    far = jaxspec.speculative_generate(target, drafters["far"], PROMPTS, gamma=3,
                                       max_new_tokens=MAX_NEW, stop=stop)
    gains = [g for row in near.accept_lengths for g in row]
    assert 4 in gains and 1 in gains
    assert far.acceptance_rate < 0.2 < near.acceptance_rate


@pytest.mark.parametrize("kind,gamma", [("far", 5), ("near", 5), ("subset", 3),
                                        ("layer_skip", 1), ("ngram", 5)])
def test_single_prompt_matches_generate(target, drafters, kind, gamma):
    prompt = [3, 14, 15, 9, 26, 5, 3, 14, 15]
    ref = jaxspec.generate(target, prompt, max_new_tokens=40)
    res = jaxspec.speculative_generate(target, drafters[kind], prompt, gamma=gamma,
                                       max_new_tokens=40)
    assert len(ref.token_ids) == 1 and len(ref.token_ids[0]) == 40
    assert res.token_ids == ref.token_ids
    _check_stats(res, gamma)


def test_gemma3_sliding_window_matches_generate(tiny):
    """Interleaved sliding (window 4) and full layers, own query scale and local rope base:
    rolling back rejected drafts must not disturb what a sliding layer sees."""
    cfg = tiny.sliding_gemma_config()
    target = tiny.model(cfg, 10, "gemma")
    prompts = [[4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23], [9, 1]]
    ref = jaxspec.generate(target, prompts, max_new_tokens=[20, 27])
    assert [len(t) for t in ref.token_ids] == [20, 27]
    for drafter in (tiny.perturbed(target, 11, 0.05), jaxspec.layer_skip_drafter(target, [2])):
        res = jaxspec.speculative_generate(target, drafter, prompts, gamma=3,
                                           max_new_tokens=[20, 27])
        assert res.token_ids == ref.token_ids, getattr(drafter, "name", "model")
        _check_stats(res, 3)


CHAT = ["Translate to French: The cat sleeps on the warm windowsill.",
        "Translate to German: I would like a cup of coffee, please."]


def test_smollm2_chat_matches_generate(smollm2):
    """A real model (the session fixture from tests/conftest.py) on chat-templated translation
    prompts. Skipping two middle layers keeps ~40% of drafts; late layers matter more in this
    small model (skipping 25 and 27 keeps under 10%). (n-gram drafts on SmolLM2:
    tests/decoding/test_stop_strings.py.)"""
    ref = jaxspec.generate(smollm2, CHAT, max_new_tokens=12, chat=True)
    assert [len(t) for t in ref.token_ids] == [12, 12]
    res = jaxspec.speculative_generate(smollm2, jaxspec.layer_skip_drafter(smollm2, [14, 16]),
                                       CHAT, gamma=3, max_new_tokens=12, chat=True)
    assert res.token_ids == ref.token_ids
    assert res.texts == ref.texts
    _check_stats(res, 3)
