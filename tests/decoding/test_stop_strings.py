"""Stop strings end rows where their text holds one: inside a token ("\\n" in Gemma's "\\n\\n"
token) or spelled over several tokens, at the same token in plain decoding, speculative chains,
gamma="auto", trees and continuous batching, and inside the loop (a row's accept lengths add up
to its ids: it did not run on to its budget).

The expected ids and texts are read off each prompt's free continuation one token at a time with
the tokenizer (`_expected`), not from the code under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import api, runner, speculative, stops
from jaxspec.drafters.hidden import head_params, hidden_drafter
from jaxspec.errors import UserError
from jaxspec.training import data

AUTO = (1.0, 1.01, 1.02, 1.03, 1.04)  # drafting nearly free: gamma="auto" drafts
TREE = [(0,), (1,), (0, 0), (0, 0, 0)]


def _expected(tok, free, strings):
    """(ids, text) of a stopped row: the ids up to the first token after which the text holds a
    stop string, the text up to just before it; all of `free` without one."""
    for k in range(1, len(free) + 1):
        text = tok.decode(free[:k], skip_special_tokens=True)
        starts = [text.find(s) for s in strings if s in text]
        if starts:
            return free[:k], text[:min(starts)]
    return free, tok.decode(free, skip_special_tokens=True)


def _check(res, want):
    assert [list(w[0]) for w in want] == res.token_ids
    assert [w[1] for w in want] == res.texts
    assert [sum(a) for a in res.accept_lengths] == [len(t) for t in res.token_ids]


GEMMA_PROMPTS = ["Name a fruit:", "Q: What is 2+2?\nA:"]


@pytest.fixture(scope="module")
def gemma_free(gemma3):
    return jaxspec.generate(gemma3, GEMMA_PROMPTS, max_new_tokens=12).token_ids


def test_newline_inside_gemmas_double_newline_token(gemma3, gemma_free):
    """Gemma writes "\\n\\n" as one token: stop="\\n" ends row 0 at its first token, row 1 at its
    single "\\n"; the text ends before the newline."""
    tok = gemma3.tokenizer
    want = [_expected(tok, f, ["\n"]) for f in gemma_free]
    assert tok.convert_ids_to_tokens(want[0][0]) == ["\n\n"] and want[0][1] == ""
    assert len(want[1][0]) > 2 and tok.convert_ids_to_tokens(want[1][0][-1]) == "\n"
    plain = jaxspec.generate(gemma3, GEMMA_PROMPTS, max_new_tokens=12, stop="\n")
    chain = jaxspec.speculative_generate(gemma3, jaxspec.ngram_drafter(3), GEMMA_PROMPTS,
                                         gamma=3, max_new_tokens=12, stop="\n")
    _check(plain, want)
    _check(chain, want)


def test_string_across_tokens_ending_inside_one(gemma3, gemma_free):
    """".\\n" is spelled by "." and the first newline of a "\\n\\n" token: row 0 stops there,
    mid-continuation; row 1 never writes it and runs to its budget (10)."""
    tok = gemma3.tokenizer
    want = [_expected(tok, f, [".\n"]) for f in (gemma_free[0], gemma_free[1][:10])]
    ids = want[0][0]
    assert 3 < len(ids) < 12 and tok.convert_ids_to_tokens(ids[-2:]) == [".", "\n\n"]
    assert len(want[1][0]) == 10
    plain = jaxspec.generate(gemma3, GEMMA_PROMPTS, max_new_tokens=[12, 10], stop=".\n")
    chain = jaxspec.speculative_generate(gemma3, jaxspec.ngram_drafter(3), GEMMA_PROMPTS,
                                         gamma=3, max_new_tokens=[12, 10], stop=".\n")
    _check(plain, want)
    _check(chain, want)


SMOL_PROMPTS = ["The cat sat on the mat. The cat sat on the", "Roses are red,"]
SMOL_STOPS = ["sat on", "p.\n"]


@pytest.fixture(scope="module")
def smol_want(smollm2):
    free = jaxspec.generate(smollm2, SMOL_PROMPTS, max_new_tokens=12).token_ids
    return [_expected(smollm2.tokenizer, f, SMOL_STOPS) for f in free]


def test_multi_token_strings_in_every_mode(smollm2, smol_want):
    """Row 0 repeats itself, so the n-gram drafter's drafts are accepted in runs and "sat on"
    (" sat", " on") completes inside a run; row 1's "p.\\n" is three tokens (" top", ".",
    "\\n"). Every mode ends both rows at the same tokens."""
    tok = smollm2.tokenizer
    assert tok.convert_ids_to_tokens(smol_want[0][0][-2:]) == ["Ġsat", "Ġon"]
    assert tok.convert_ids_to_tokens(smol_want[1][0][-3:]) == ["Ġtop", ".", "Ċ"]
    assert smol_want[0][1].endswith(" cat ") and smol_want[1][1].endswith(" to")
    ngram, kw = jaxspec.ngram_drafter(3), dict(max_new_tokens=12, stop=SMOL_STOPS)
    chain = jaxspec.speculative_generate(smollm2, ngram, SMOL_PROMPTS, gamma=3, **kw)
    assert chain.accept_lengths[0][-1] > 1  # " sat" was an accepted draft
    for res in (jaxspec.generate(smollm2, SMOL_PROMPTS, **kw), chain,
                jaxspec.speculative_generate(smollm2, ngram, SMOL_PROMPTS, gamma="auto",
                                             costs=AUTO, **kw)):
        _check(res, smol_want)


def test_continuous_batching_stops_the_same(smollm2, smol_want):
    out = dict(api.stream_generate(smollm2, SMOL_PROMPTS, batch_size=2, max_new_tokens=12,
                                      stop=SMOL_STOPS))
    assert [out[i] for i in range(2)] == [list(w[0]) for w in smol_want]


@pytest.fixture(scope="module")
def byte_model(tiny):
    """A tiny random model over the byte tokenizer: most bytes it writes are parts of characters,
    "\\ufffd" alone, which the host may decode into one character."""
    cfg = tiny.config(vocab_size=264, eos_token_ids=(2,))
    return jaxspec.Model(cfg, tiny.model(cfg, 0).params, data.byte_tokenizer(), "bytes")


def test_trees_stop_the_same(tiny, byte_model):
    """A static tree drafted by a noisy copy and a random EAGLE head's dynamic trees end row 0
    at the second of two ASCII letters it writes mid-way (the stop string), as plain decoding
    does."""
    prompts, tok = ["Hello there,", "ab"], byte_model.tokenizer
    free = jaxspec.generate(byte_model, prompts, max_new_tokens=20).token_ids
    letter = [tok.decode([t]).isascii() and tok.decode([t]).isalpha() for t in free[0]]
    i = next(i for i in range(2, 18) if letter[i] and letter[i + 1]
             and tok.decode(free[0][i:i + 2]) not in tok.decode(free[0][:i + 1]))
    stop = tok.decode(free[0][i:i + 2])
    want = [_expected(tok, f, [stop]) for f in free]
    assert len(want[0][0]) == i + 2
    kw = dict(max_new_tokens=20, stop=stop)
    tree = jaxspec.speculative_generate(byte_model, tiny.perturbed(byte_model, 2, 0.05), prompts,
                                        tree=TREE, **kw)
    assert max(map(max, tree.accept_lengths)) > 1
    eagle = hidden_drafter(byte_model, "eagle", head_params("eagle", byte_model.config, 4,
                                                            jax.random.key(8), byte_model.params))
    dynamic = jaxspec.speculative_generate(byte_model, eagle, prompts, tree="dynamic:6:3:3", **kw)
    for res in (jaxspec.generate(byte_model, prompts, **kw), tree, dynamic):
        _check(res, want)


def test_automata_match_the_host_rule_on_random_text(smollm2):
    """`speculative._first_stop` with the built tables, over random sequences of tokens made of
    the stop strings' characters (so partial matches fail and restart often, as KMP's "aab"
    after "aa"), in two steps, the first with junk past its gain: the token it ends a row at is
    where the decoded text first holds a stop string."""
    tok = smollm2.tokenizer
    strings = ["aab", "abab", "b a", "\n\n"]
    built, _ = stops.tables(smollm2, strings)
    texts = stops.token_texts(tok)
    pool = [texts.index(x) for x in ["a", "b", "aa", "ab", "ba", "bb", "aba", "aaaa", " a", " b",
                                     " ab", " ba", " bab", " ", "\n", "\n\n", " \n"]]
    rng = np.random.default_rng(0)
    B, G1 = 64, 6
    seqs_BxN = rng.choice(pool, (B, 2 * G1))
    gain_B = rng.integers(1, G1 + 1, B)
    first_B, state_BxS = speculative._first_stop(
        built, jnp.zeros((B, len(strings)), jnp.int32), jnp.asarray(seqs_BxN[:, :G1]),
        jnp.asarray(gain_B))
    then_BxG1 = np.stack([s[g:g + G1] for s, g in zip(seqs_BxN, gain_B)])
    second_B, _ = speculative._first_stop(built, state_BxS, jnp.asarray(then_BxG1),
                                          jnp.full(B, G1))
    stopped = 0
    for b, g in enumerate(gain_B):
        text = list(seqs_BxN[b, :g + G1])
        kept = (first_B[b] + 1 if first_B[b] < G1 else
                g + second_B[b] + 1 if second_B[b] < G1 else len(text))
        assert kept == len(_expected(tok, text, strings)[0]), (b, text)
        stopped += kept < len(text)
    assert stopped > B // 2


def test_stop_input(gemma3, smollm2, target):
    ids = runner.stop_ids(gemma3, "\n")  # what transformers' eos_token_id gets
    assert {1, 107, 108} <= set(ids)
    assert all("\n" in stops.token_texts(gemma3.tokenizer)[i] for i in ids if i != 1)
    assert runner.stop_ids(smollm2, ["sat on", 5]) == (2, 5)
    assert runner.stop_ids(smollm2, "<|im_start|>") == (1, 2)  # a special token: its id
    for bad, match in [("", "empty stop string"), (1.5, "stop must be"), ([["a"]], "stop must be"),
                       (True, "stop must be"), (10 ** 6, "stop must be"),
                       ({"a": 1}, "stop must be")]:
        with pytest.raises(UserError, match=match):
            jaxspec.generate(smollm2, "Hi", max_new_tokens=2, stop=bad)
    with pytest.raises(UserError, match="needs a model with a tokenizer"):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=2, stop="ab")
