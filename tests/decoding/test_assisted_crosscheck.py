"""Cross-check against an independent implementation: transformers' greedy and assisted
generation (PyTorch), run on the same target and drafter weights exported from jaxspec, emit the
same tokens as `jaxspec.generate` and `jaxspec.speculative_generate`.

Both sides share the eos id, so where one stops the other must stop too.
"""

import numpy as np
import pytest
import torch
import transformers as tf

import jaxspec
from jaxspec.checkpoints import hf

EOS = 43  # the target emits it early in the first row only
PROMPTS = [[5, 17, 3, 22, 9], [7], [12, 30, 12, 30, 40, 41, 42, 12, 30, 12, 30, 8]]
MAX_NEW = 30


def to_transformers(model):
    """A LlamaForCausalLM holding `model`'s weights (tied head included)."""
    cfg = tf.LlamaConfig(**hf.hf_config_from_config(model.config))
    torch_model = tf.LlamaForCausalLM(cfg).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in
             hf.hf_state_from_params(model.params, model.config).items()}
    missing, unexpected = torch_model.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}
    if missing:  # tied: the head must be the embedding we loaded
        assert model.config.tie_embeddings
        assert torch.equal(torch_model.lm_head.weight, torch_model.model.embed_tokens.weight)
    return torch_model


@pytest.fixture(scope="module")
def models(tiny):
    cfg = tiny.config(eos_token_ids=(EOS,), max_position=128)
    target = tiny.model(cfg, 0, "target")
    drafter = tiny.perturbed(target, 2, 0.05, name="draft")
    return target, drafter


@pytest.fixture(scope="module")
def hf_outputs(models):
    """(greedy, assisted) new tokens per prompt, from transformers, batch 1 each (assisted
    generation takes one row at a time)."""
    target, drafter = (to_transformers(m) for m in models)
    greedy, assisted = [], []
    common = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS, pad_token_id=0)
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            mask = torch.ones_like(ids)
            g = target.generate(ids, attention_mask=mask, **common)
            a = target.generate(ids, attention_mask=mask, assistant_model=drafter, **common)
            greedy.append(g[0, len(prompt):].tolist())
            assisted.append(a[0, len(prompt):].tolist())
    return greedy, assisted


def test_transformers_logits_agree(models):
    """The export itself: same logits to float32 precision (else token checks mean little)."""
    target, _ = models
    tokens = np.array([PROMPTS[2]])
    with torch.no_grad():
        ref = to_transformers(target)(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(jaxspec.score(target, tokens), ref, atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers(models, hf_outputs):
    target, _ = models
    greedy, assisted = hf_outputs
    assert assisted == greedy  # transformers agrees with itself
    assert any(len(g) == MAX_NEW for g in greedy)  # some row runs to the budget ...
    assert any(len(g) < MAX_NEW and g[-1] == EOS for g in greedy)  # ... and some stops at eos
    res = jaxspec.generate(target, PROMPTS, MAX_NEW)
    assert res.token_ids == greedy


def test_speculative_matches_transformers_assisted(models, hf_outputs):
    target, drafter = models
    _, assisted = hf_outputs
    res = jaxspec.speculative_generate(target, drafter, PROMPTS, gamma=4, max_new_tokens=MAX_NEW)
    assert res.token_ids == assisted
    assert 0 < res.acceptance_rate < 1  # drafts were both accepted and rejected
