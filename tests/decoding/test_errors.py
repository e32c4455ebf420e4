"""Bad arguments fail early, before anything compiles, with a message naming the problem."""

import pytest

import jaxspec
from jaxspec.decoding.sampling import Sampling


def test_drafter_vocabulary_mismatch(tiny, target):
    big = tiny.model(tiny.config(vocab_size=80), 4, "big")
    with pytest.raises(ValueError, match=r"drafter vocabulary \(80\) does not match the "
                                         r"target's \(64\)"):
        jaxspec.speculative_generate(target, big, [[1, 2, 3]], gamma=2, max_new_tokens=4)
    small = tiny.model(tiny.config(vocab_size=48), 4, "small")
    with pytest.raises(ValueError, match=r"drafter vocabulary \(48\) does not match"):
        jaxspec.speculative_generate(target, jaxspec.model_drafter(small), [[1, 2, 3]], gamma=2,
                                     max_new_tokens=4)


def test_reduced_head_vocab_ids(tiny, target):
    with pytest.raises(ValueError, match="drafter vocab_ids reach 70, target vocabulary is 64"):
        jaxspec.speculative_generate(
            target, tiny.subset_head_drafter(target, list(range(10)) + [70]), [[1, 2]], gamma=2,
            max_new_tokens=4)
    cfg = target.config.replace(tie_embeddings=False, head_vocab_size=4)
    head = jaxspec.Model(cfg, {**target.params, "lm_head": target.params["embed"][:4]})
    with pytest.raises(ValueError, match="needs vocab_ids"):
        jaxspec.model_drafter(head)
    with pytest.raises(ValueError, match=r"vocab_ids has shape \(3,\), head has 4 entries"):
        jaxspec.model_drafter(head, [0, 1, 2])
    with pytest.raises(ValueError, match="only such a drafter takes them"):
        jaxspec.model_drafter(target, [0, 1, 2])


@pytest.mark.parametrize("gamma", [0, -1])
def test_gamma_below_one(target, gamma):
    with pytest.raises(ValueError, match=f"gamma must be >= 1 with a drafter, got {gamma}"):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [[1, 2]], gamma=gamma)


def test_missing_or_bad_drafter(target):
    with pytest.raises(ValueError, match="needs a drafter"):
        jaxspec.speculative_generate(target, None, [[1, 2]])
    with pytest.raises(TypeError, match="cannot draft with str"):
        jaxspec.speculative_generate(target, "ngram", [[1, 2]])
    with pytest.raises(ValueError, match="max_ngram must be >= 1"):
        jaxspec.ngram_drafter(0)
    with pytest.raises(ValueError, match=r"skip_layers \[2\] out of range for 2 layers"):
        jaxspec.layer_skip_drafter(target, [2])
    with pytest.raises(ValueError, match="would skip every layer"):
        jaxspec.layer_skip_drafter(target, [0, 1])


def test_length_beyond_max_position(target):
    # 3 + 509 + gamma 0 + 1 = 513 > 512
    with pytest.raises(ValueError, match=r"= 513 exceeds the model's 512 positions"):
        jaxspec.generate(target, [[1, 2, 3]], max_new_tokens=509)
    # The draft window counts too: 3 + 505 + gamma 4 + 1 = 513.
    with pytest.raises(ValueError, match=r"= 513 exceeds the model's 512 positions"):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [[1, 2, 3]], gamma=4,
                                     max_new_tokens=505)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        jaxspec.generate(target, [list(range(60)) * 9], max_new_tokens=1)


@pytest.mark.parametrize("max_new", [0, -3, [4, 0]])
def test_max_new_tokens_below_one(target, max_new):
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        jaxspec.generate(target, [[1, 2], [3]], max_new_tokens=max_new)


def test_max_new_tokens_list_of_wrong_length(target):
    with pytest.raises(ValueError, match="max_new_tokens has 3 entries for 2 prompts"):
        jaxspec.generate(target, [[1, 2], [3]], max_new_tokens=[4, 5, 6])


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.5), r"temperature must be >= 0, got -0.5"),
    (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(temperature=1.0, top_p=-0.1), r"top_p must be in \(0, 1\], got -0.1"),
    (dict(temperature=1.0, top_k=0), r"top_k must be >= 1, got 0"),
])
def test_sampling_settings(target, kw, msg):
    with pytest.raises(ValueError, match=msg):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match=msg):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [[1, 2]], gamma=2,
                                     max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match=msg):
        Sampling(**kw)


@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_token_id_outside_vocabulary(target, bad):
    msg = rf"token id {bad} is outside the vocabulary \[0, 64\)"
    with pytest.raises(ValueError, match=msg):
        jaxspec.generate(target, [[1, 2], [3, bad, 4]], max_new_tokens=4)
    with pytest.raises(ValueError, match=msg):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [bad], gamma=2,
                                     max_new_tokens=4)


def test_empty_prompts(target):
    with pytest.raises(ValueError, match="empty prompt"):
        jaxspec.generate(target, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        jaxspec.speculative_generate(target, jaxspec.ngram_drafter(), [[1, 2], []], gamma=2,
                                     max_new_tokens=4)
    with pytest.raises(ValueError, match="no prompts given"):
        jaxspec.generate(target, [], max_new_tokens=4)


def test_strings_without_tokenizer(target):
    with pytest.raises(ValueError, match="string prompts need a model with a tokenizer"):
        jaxspec.generate(target, "hello", max_new_tokens=4)



def test_drafter_with_another_tokenizer_is_refused(target, far_model):
    import dataclasses

    from jaxspec.training.data import byte_tokenizer

    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    t = dataclasses.replace(target, tokenizer=byte_tokenizer())
    d = dataclasses.replace(far_model, tokenizer=other)
    with pytest.raises(ValueError, match="drafter's tokenizer"):
        jaxspec.speculative_generate(t, d, [[1, 2, 3]], gamma=2, max_new_tokens=4)


@pytest.mark.parametrize("kw, match", [
    ({"gamma": 2.0}, "gamma must be an int"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be ints"),
])
def test_non_integer_settings_are_refused(target, far_model, kw, match):
    with pytest.raises(ValueError, match=match):
        jaxspec.speculative_generate(target, far_model, [[1, 2, 3]], **{"gamma": 2, **kw})


def test_float_token_ids_are_refused(target):
    with pytest.raises(ValueError, match="must be integers"):
        jaxspec.generate(target, [[1.5, 2.0]], max_new_tokens=2)
