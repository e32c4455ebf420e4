"""fp32 parity of the forward pass against transformers (PyTorch) on tiny random models.

Each case builds a transformers model from a config with random weights, converts its state dict
with `hf.params_from_hf_state` and the config with `hf.config_from_hf(config.to_dict())`, and
checks logits: a full-sequence pass, token-by-token decoding through the KV cache, and a batch
whose rows sit at different positions. Invariants (causality, jit == no-jit) run on jaxspec alone.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

from jaxspec.checkpoints import hf
from jaxspec.config import ModelConfig
from jaxspec.models.cache import init_cache
from jaxspec.models.params import init_params
from jaxspec.models.transformer import forward

TOL = 1e-4
SEQ = 12
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)

# name -> (transformers config class, model class, config kwargs)
CASES = {
    "llama_gqa_untied": (tf.LlamaConfig, tf.LlamaForCausalLM,
                         dict(SMALL, tie_word_embeddings=False)),
    "llama_tied": (tf.LlamaConfig, tf.LlamaForCausalLM,
                   dict(SMALL, tie_word_embeddings=True, rope_theta=500.0)),
    # head_dim 16, theta 1e4: wavelengths 6.3, 20, 63, ... against original_max_position 32 put
    # one frequency in each Llama 3 band (kept, smoothed, divided by the factor).
    "llama3_rope": (tf.LlamaConfig, tf.LlamaForCausalLM,
                    dict(SMALL, hidden_size=64, tie_word_embeddings=False, rope_parameters=dict(
                        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(SMALL, tie_word_embeddings=False)),
    "qwen2_tied_mha": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                       dict(SMALL, num_key_value_heads=4, tie_word_embeddings=True)),
    # head_dim 16 != hidden / heads (8), as Qwen3's 128 is for most sizes.
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
              dict(SMALL, head_dim=16, tie_word_embeddings=False, rope_theta=1_000_000.0)),
    "qwen3_tied": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
                   dict(SMALL, head_dim=8, tie_word_embeddings=True)),
    # Both layer kinds, window 4 < SEQ, distinct rope bases, query_pre_attn_scalar != head_dim.
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
               dict(SMALL, num_hidden_layers=3, head_dim=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_theta=1_000_000.0, rope_local_base_freq=100.0,
                    query_pre_attn_scalar=24, max_position_embeddings=64)),
    "gemma3_untied": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                      dict(SMALL, head_dim=8, sliding_window=3, tie_word_embeddings=False,
                           layer_types=["full_attention", "sliding_attention"],
                           rope_theta=10_000.0, rope_local_base_freq=50.0)),
}


@pytest.fixture(autouse=True)
def _strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


def _randomize(model, gemma: bool):
    """Weights large enough that a layout or rope mistake moves logits by far more than TOL."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = torch.randn_like(p) * (0.1 if name.endswith("norm.weight") else 0.25)
            if name.endswith("norm.weight") and not gemma:
                w += 1.0  # Llama stores the multiplier, Gemma stores multiplier - 1
            p.copy_(w)


@functools.lru_cache(maxsize=None)
def _case(name):
    """(transformers model, jaxspec config, jaxspec params) for a case, built once."""
    cfg_cls, model_cls, kw = CASES[name]
    hf_config = cfg_cls(**kw)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(hf_config).eval().float()
    _randomize(model, gemma=name.startswith("gemma"))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    config = hf.config_from_hf(hf_config.to_dict())
    params = hf.params_from_hf_state(state.__getitem__, config)
    return model, config, jax.tree.map(jnp.asarray, params)


def _hf_logits(model, tokens_BxS, positions_BxS=None):
    with torch.no_grad():
        kw = {} if positions_BxS is None else {"position_ids": torch.as_tensor(positions_BxS)}
        return model(input_ids=torch.as_tensor(np.asarray(tokens_BxS)), **kw).logits.numpy()


_forward = jax.jit(forward, static_argnames=("config", "layers"))


def _tokens(batch, seq, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, seq)).astype(np.int32)


def _positions(batch, seq, start=0):
    return np.broadcast_to(np.arange(start, start + seq, dtype=np.int32), (batch, seq))


def _max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def test_config_from_hf_reads_transformers_dicts():
    """What transformers 5 writes (`rope_parameters`, `layer_types`) lands in ModelConfig."""
    llama3 = _case("llama3_rope")[1]
    assert llama3.arch == "llama" and llama3.head_dim == 16 and not llama3.tie_embeddings
    assert llama3.rope_theta == 10000.0
    assert (llama3.rope_scaling.kind, llama3.rope_scaling.factor) == ("llama3", 8.0)
    assert llama3.rope_scaling.original_max_position == 32
    assert _case("llama_tied")[1].tie_embeddings and _case("llama_tied")[1].rope_theta == 500.0
    assert _case("qwen2")[1].qkv_bias and not _case("qwen2")[1].tie_embeddings
    assert not _case("llama_gqa_untied")[1].qkv_bias
    g = _case("gemma3")[1]
    assert g.arch == "gemma3" and g.layer_types == ("sliding", "full", "sliding")
    assert (g.sliding_window, g.rope_theta, g.rope_local_theta) == (4, 1_000_000.0, 100.0)
    assert g.rope_scaling is None and g.query_scale == pytest.approx(24 ** -0.5)
    assert (g.num_heads, g.num_kv_heads, g.head_dim) == (4, 2, 16)


@pytest.mark.parametrize("kw", [dict(attention_bias=True), dict(mlp_bias=True)])
def test_llama_output_and_mlp_biases_are_rejected(kw):
    """Llama's attention_bias also biases o_proj: loading must refuse, not drop the bias."""
    with pytest.raises(ValueError, match="attention_bias or mlp_bias"):
        hf.config_from_hf(tf.LlamaConfig(**SMALL, **kw).to_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_full_sequence_matches_transformers(name):
    model, config, params = _case(name)
    tokens = _tokens(2, SEQ)
    want = _hf_logits(model, tokens)
    assert np.abs(want).max() > 1.0  # random weights produce logits well above TOL
    got, _ = _forward(params, config, tokens, _positions(2, SEQ), init_cache(config, 2, SEQ))
    assert got.dtype == jnp.float32 and got.shape == (2, SEQ, VOCAB)
    assert _max_diff(got, want) < TOL


@pytest.mark.parametrize("name", list(CASES))
def test_token_by_token_decoding_matches_full_sequence(name):
    """One token per call through the cache, each step against the full-sequence reference."""
    model, config, params = _case(name)
    tokens = _tokens(1, SEQ, seed=1)
    want = _hf_logits(model, tokens)
    cache = init_cache(config, 1, SEQ + 4)  # longer than needed: unwritten slots are masked
    for t in range(SEQ):
        step, cache = _forward(params, config, tokens[:, t:t + 1], np.array([[t]], np.int32),
                               cache)
        assert _max_diff(step[:, 0], want[:, t]) < TOL, f"step {t}"


@pytest.mark.parametrize("name", list(CASES))
def test_rows_at_different_positions(name):
    """Batch 2 with its own length per row: row 0 prefills 5 tokens (then 4 junk tokens that the
    decode steps overwrite, as after a rejected draft), row 1 prefills 9, then both decode one
    token per call at different positions. Each row must match its own full sequence."""
    model, config, params = _case(name)
    seq = 16
    tokens = _tokens(2, seq, seed=2)
    want = _hf_logits(model, tokens)
    junk = _tokens(1, 4, seed=3)
    prefill = np.stack([np.concatenate([tokens[0, :5], junk[0]]), tokens[1, :9]])
    cache = init_cache(config, 2, seq)
    got, cache = _forward(params, config, prefill, _positions(2, 9), cache)
    assert _max_diff(got[0, :5], want[0, :5]) < TOL
    assert _max_diff(got[1], want[1, :9]) < TOL
    for step in range(7):
        pos = np.array([[5 + step], [9 + step]], np.int32)
        got, cache = _forward(params, config, np.take_along_axis(tokens, pos, 1), pos, cache)
        assert _max_diff(got[0, 0], want[0, 5 + step]) < TOL, f"row 0, position {5 + step}"
        assert _max_diff(got[1, 0], want[1, 9 + step]) < TOL, f"row 1, position {9 + step}"


@pytest.mark.parametrize("name", ["llama3_rope", "gemma3"])
def test_offset_positions_match_transformers(name):
    """Chunked prefill: a second chunk at positions 7.. over the cache equals the full pass."""
    model, config, params = _case(name)
    tokens = _tokens(1, SEQ, seed=4)
    want = _hf_logits(model, tokens)
    cache = init_cache(config, 1, SEQ)
    _, cache = _forward(params, config, tokens[:, :7], _positions(1, 7), cache)
    got, _ = _forward(params, config, tokens[:, 7:], _positions(1, SEQ - 7, start=7), cache)
    assert _max_diff(got, want[:, 7:]) < TOL


# Invariants on jaxspec alone, with random `init_params`.
INVARIANT_CONFIGS = {
    "llama": ModelConfig(arch="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                         tie_embeddings=False, qkv_bias=True),
    "gemma3": ModelConfig(arch="gemma3", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                          num_heads=4, num_kv_heads=1, head_dim=8, intermediate_size=48,
                          tie_embeddings=False, sliding_window=4, layer_types=("sliding", "full"),
                          rope_local_theta=100.0),
}


def _input_gradient_norms(config, params, tokens_1xS):
    """|d logits[t] / d x[t']| (projected on a random direction) for all t, t', where x is the
    input embedding (before any scaling) of each position."""
    S = tokens_1xS.shape[1]
    x0_SxD = params["embed"][tokens_1xS[0]]

    def logits_from_inputs(x_SxD):
        # Distinct tokens: give each position its own embedding row, so moving row
        # tokens[t'] moves position t' only. The head is untied, so no row also feeds the head.
        embed = params["embed"].at[tokens_1xS[0]].set(x_SxD)
        logits, _ = forward({**params, "embed": embed}, config, tokens_1xS, _positions(1, S),
                            init_cache(config, 1, S))
        return logits[0]

    @jax.jit
    def grads(x_SxD):
        # Row t: the gradient of logits[t] . r for a random r, w.r.t. every input position.
        _, vjp = jax.vjp(logits_from_inputs, x_SxD)
        r_V = jax.random.normal(jax.random.key(9), (config.vocab_size,))
        cot_SxSxV = jnp.eye(S)[:, :, None] * r_V[None, None, :]
        return jax.vmap(vjp)(cot_SxSxV)[0]

    return np.asarray(jnp.linalg.norm(grads(x0_SxD), axis=-1))  # [t, t']


@pytest.mark.parametrize("name", list(INVARIANT_CONFIGS))
def test_causality(name):
    """d logits[t] / d input[t'] is exactly zero for t' > t, and not for t' <= t."""
    config = INVARIANT_CONFIGS[name]
    params = init_params(config, jax.random.key(0), std=0.3)
    S = 10
    tokens = np.random.default_rng(5).permutation(VOCAB)[:S][None].astype(np.int32)
    norms_SxS = _input_gradient_norms(config, params, tokens)
    future = np.triu(np.ones((S, S), bool), k=1)
    assert np.all(norms_SxS[future] == 0.0)
    assert np.all(norms_SxS[~future] > 1e-6)


def test_sliding_window_limits_the_receptive_field():
    """One sliding layer of window 4: logits[t] depend on inputs t-3..t only."""
    config = INVARIANT_CONFIGS["gemma3"].replace(num_layers=1, layer_types=("sliding",))
    params = init_params(config, jax.random.key(1), std=0.3)
    S = 10
    tokens = np.random.default_rng(6).permutation(VOCAB)[:S][None].astype(np.int32)
    norms_SxS = _input_gradient_norms(config, params, tokens)
    t, t_in = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
    seen = (t_in <= t) & (t_in > t - 4)
    assert np.all(norms_SxS[~seen] == 0.0)
    assert np.all(norms_SxS[seen] > 1e-6)


@pytest.mark.parametrize("name", list(INVARIANT_CONFIGS))
def test_jit_and_no_jit_agree(name):
    config = INVARIANT_CONFIGS[name]
    params = init_params(config, jax.random.key(2), std=0.3)
    tokens, positions = _tokens(2, 6, seed=7), _positions(2, 6)
    cache = init_cache(config, 2, 8)
    jitted, jit_cache = _forward(params, config, tokens, positions, cache)
    with jax.disable_jit():
        eager, eager_cache = forward(params, config, tokens, positions, cache)
    assert _max_diff(jitted, eager) < 1e-5
    assert _max_diff(jnp.stack(jit_cache.keys), jnp.stack(eager_cache.keys)) < 1e-5
    assert _max_diff(jnp.stack(jit_cache.values), jnp.stack(eager_cache.values)) < 1e-5
    # The cache holds exactly the written slots: 6 of 8, the rest untouched zeros.
    keys_LxBxTxKxH = np.stack(jit_cache.keys)
    assert np.all(keys_LxBxTxKxH[:, :, 6:] == 0)
    assert np.all(np.abs(keys_LxBxTxKxH[:, :, :6]).sum(-1) > 0)


def test_layers_subset_runs_listed_layers():
    """`layers=(1,)` equals a one-layer model holding layer 1's weights."""
    config = INVARIANT_CONFIGS["llama"]
    params = init_params(config, jax.random.key(3), std=0.3)
    tokens, positions = _tokens(1, 5, seed=8), _positions(1, 5)
    sub, _ = _forward(params, config, tokens, positions, init_cache(config, 1, 5, num_layers=1),
                      layers=(1,))
    one = config.replace(num_layers=1)
    one_params = {**params, "layers": params["layers"][1:2]}
    want, _ = _forward(one_params, one, tokens, positions, init_cache(one, 1, 5))
    assert _max_diff(sub, want) < 1e-6
    with pytest.raises(ValueError, match="cache has 2 layers"):
        forward(params, config, tokens, positions, init_cache(config, 1, 5), layers=(0,))
