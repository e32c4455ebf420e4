"""The runner pads batch size and prompt length to buckets, so a new prompt of similar length
reuses the compiled function (a cache lookup) instead of compiling again."""

import pytest

import jaxspec
from jaxspec.decoding import runner


@pytest.fixture(scope="module")
def model(tiny):
    # A config no other test uses, so the first call of each test really compiles.
    return tiny.model(tiny.config(intermediate_size=40), 30, "bucketed")


def test_similar_prompts_reuse_the_compiled_function(model):
    compiled = runner._DECODER._compiled
    n0 = len(compiled)
    first = jaxspec.generate(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 4]], max_new_tokens=6)
    assert len(compiled) == n0 + 1
    # Other prompts under the 16-token prompt bucket, other budgets under the 128-slot cache
    # bucket, another seed: the same compiled function.
    again = jaxspec.generate(model, [[10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]],
                             max_new_tokens=[12, 30], seed=5)
    assert len(compiled) == n0 + 1
    assert again.compile_time_s < 0.05
    assert first.compile_time_s > 10 * again.compile_time_s
    assert [len(t) for t in again.token_ids] == [12, 30]

    # 3 rows pad to a batch of 4 and compile once; 4 rows then reuse it.
    three = jaxspec.generate(model, [[5], [6, 7], [8, 9, 10]], max_new_tokens=[4, 5, 6])
    assert len(compiled) == n0 + 2 and len(three.token_ids) == 3  # padded rows not returned
    four = jaxspec.generate(model, [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 9, 7, 9], [2, 7, 1], [8],
                                    [2, 8, 1, 8]], max_new_tokens=[5, 9, 20, 2], seed=6)
    assert len(compiled) == n0 + 2
    assert four.compile_time_s < 0.05
    assert [len(t) for t in four.token_ids] == [5, 9, 20, 2]


def test_short_prompts_reuse_the_compiled_function(model):
    """Prompt + budget under the prompt bucket: the prefill length must still not vary."""
    compiled = runner._DECODER._compiled
    jaxspec.generate(model, [[1, 2], [3]], max_new_tokens=5)
    n = len(compiled)
    again = jaxspec.generate(model, [[1, 2, 3], [4]], max_new_tokens=5)
    jaxspec.generate(model, [[4], [5]], max_new_tokens=[7, 2])
    assert len(compiled) == n
    assert again.compile_time_s < 0.05


def test_speculative_reuses_the_compiled_function(model):
    compiled = runner._DECODER._compiled
    first = jaxspec.speculative_generate(model, jaxspec.ngram_drafter(2), [[1, 2, 1, 2, 1]],
                                         gamma=3, max_new_tokens=8)
    n = len(compiled)
    again = jaxspec.speculative_generate(model, jaxspec.ngram_drafter(2), [[7, 3, 3, 7, 3, 3]],
                                         gamma=3, max_new_tokens=20, seed=1)
    assert len(compiled) == n
    assert again.compile_time_s < 0.05
    assert first.compile_time_s > 10 * again.compile_time_s
