"""Qwen3, the architecture added as one table (`jaxspec/archs/qwen3.py`): its config.json and GGUF
read into the same model transformers runs, and every drafter kind decodes it exactly.

Logits parity over the forward pass (full sequence, through the cache, ragged rows) is in
`tests/models/test_parity.py`, HF export in `tests/checkpoints/test_export.py`: the "qwen3" rows
of their tables.
"""

import gguf as gguf_pkg
import jax
import numpy as np
import pytest
import torch
import transformers as tf

import jaxspec
from jaxspec.checkpoints import gguf, hf
from jaxspec.drafters.hidden import head_params
from jaxspec.errors import UserError
from jaxspec.models.params import init_params

VOCAB = 96
HF_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                rope_theta=1_000_000.0, tie_word_embeddings=False)
# transformers name under model.layers.{i}. -> GGUF name under blk.{i}. (llama.cpp's qwen3)
GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


@pytest.fixture(scope="module")
def hf_model():
    config = tf.Qwen3Config(**HF_SMALL)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms are multipliers, around 1
            p.copy_(torch.randn_like(p) * (0.1 if name.endswith("norm.weight") else 0.25)
                    + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def _hf_logits(model, tokens_BxS):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens_BxS)).logits.numpy()


def _jax_logits(config, params, tokens_BxS):
    out = jaxspec.score(jaxspec.Model(config, params, None, "qwen3"), tokens_BxS)
    return np.asarray(out)


def test_config_json_reads_into_qwen3():
    config = hf.config_from_hf(tf.Qwen3Config(**HF_SMALL).to_dict())
    assert (config.arch, config.head_dim, config.num_kv_heads) == ("qwen3", 16, 2)
    assert not config.qkv_bias and not config.tie_embeddings and config.rope_theta == 1e6
    for bad, match in ((dict(attention_bias=True), "attention_bias"),
                       (dict(use_sliding_window=True, sliding_window=8), "sliding window")):
        with pytest.raises(UserError, match=match):
            hf.config_from_hf(tf.Qwen3Config(**HF_SMALL, **bad).to_dict())


def _write_gguf(path, model):
    """The model as llama.cpp's converter writes a float32 Qwen3 GGUF (q/k rows not permuted)."""
    c = model.config
    w = gguf_pkg.GGUFWriter(str(path), "qwen3")
    for key, value in {"block_count": c.num_hidden_layers, "context_length": 256,
                       "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
                       "attention.head_count": c.num_attention_heads,
                       "attention.head_count_kv": c.num_key_value_heads,
                       "attention.key_length": c.head_dim,
                       "attention.value_length": c.head_dim}.items():
        w.add_uint32(f"qwen3.{key}", value)
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32("qwen3.rope.freq_base", 1_000_000.0)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    for name, t in model.state_dict().items():
        if name in GGUF_TOP:
            out = GGUF_TOP[name]
        else:
            _, _, i, *rest = name.split(".")
            base, suffix = ".".join(rest[:-1]), rest[-1]
            out = f"blk.{i}.{GGUF_BLOCK[base]}.{suffix}"
        w.add_tensor(out, t.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_the_model_transformers_runs(hf_model, tmp_path):
    _write_gguf(tmp_path / "qwen3.gguf", hf_model)
    config, params = gguf.load_gguf(tmp_path / "qwen3.gguf")
    assert (config.arch, config.head_dim, config.tie_embeddings) == ("qwen3", 16, False)
    assert "q_norm" in params["layers"][0] and "bq" not in params["layers"][0]
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12)).astype(np.int32)
    want = _hf_logits(hf_model, tokens)
    assert np.abs(want).max() > 1.0
    assert np.max(np.abs(_jax_logits(config, params, tokens) - want)) < 1e-4


# -- every drafter kind on a Qwen3 target ---------------------------------------------------

PROMPTS = [[5, 17, 3, 22, 9, 41, 5, 17, 3], [7], [12, 30] * 9 + [1]]
MAX_NEW = [21, 13, 17]
DRAFT_CONFIG = jaxspec.ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, num_layers=3,
                                   num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                                   max_position=512)


def _model(seed, name):
    return jaxspec.Model(DRAFT_CONFIG, init_params(DRAFT_CONFIG, jax.random.key(seed), std=0.5),
                         None, name)


def _drafters(target):
    near = jax.tree.map(lambda p, n: p + 0.1 * np.std(p) * n if p.ndim > 1 else p, target.params,
                        init_params(DRAFT_CONFIG, jax.random.key(9), std=1.0))
    heads = {kind: jaxspec.hidden_drafter(target, kind, head_params(
        kind, DRAFT_CONFIG, 3, jax.random.key(4), target.params), depth=3)
        for kind in ("medusa", "hydra", "eagle")}
    skip = jaxspec.layer_skip_drafter(target, [1])
    return {"far": jaxspec.model_drafter(_model(1, "far")),
            "near": jaxspec.model_drafter(jaxspec.Model(DRAFT_CONFIG, near, None, "near")),
            "layer_skip": skip, "ngram": jaxspec.ngram_drafter(3),
            "staged": jaxspec.staged_drafter(skip), **heads,
            "eagle+ngram-tree": jaxspec.hybrid_drafter(heads["eagle"], 3, 3)}


def test_every_drafter_kind_decodes_qwen3_exactly():
    target = _model(0, "target")
    want = jaxspec.generate(target, PROMPTS, MAX_NEW).token_ids
    taus = {}
    for kind, drafter in _drafters(target).items():
        res = jaxspec.speculative_generate(target, drafter, PROMPTS, gamma=2, max_new_tokens=MAX_NEW)
        assert res.token_ids == want, kind
        taus[kind] = res.tau
    # The noisy copy and lookup over the repeating prompt are accepted: both paths ran.
    assert taus["near"] > 1.3 and taus["ngram"] > 1.1, taus
