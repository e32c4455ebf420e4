"""Checkpoint round trips: HF export read by transformers and by `jaxspec.load`, the orbax store
(also onto a sharding), and sharded safetensors directories."""

import json

import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import jaxspec
from jaxspec.checkpoints import hf, store
from jaxspec.config import ModelConfig, RopeScaling
from jaxspec.models.cache import init_cache
from jaxspec.models.params import init_params
from jaxspec.models.transformer import forward

VOCAB = 64
_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, intermediate_size=48, max_position=128, bos_token_id=1,
             eos_token_ids=(2,), pad_token_id=0)
CONFIGS = {
    "llama": ModelConfig(arch="llama", **_BASE, tie_embeddings=False, rope_theta=500.0),
    "llama_tied_llama3_rope": ModelConfig(
        arch="llama", **{**_BASE, "head_dim": 16}, rope_theta=10000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 32)),
    "qwen2": ModelConfig(arch="llama", **_BASE, tie_embeddings=False, qkv_bias=True),
    "qwen3": ModelConfig(arch="qwen3", **{**_BASE, "head_dim": 16}, tie_embeddings=False,
                         rope_theta=1e6),
    "gemma3": ModelConfig(arch="gemma3", **{**_BASE, "num_layers": 3}, rope_theta=1e6,
                          rope_local_theta=100.0, sliding_window=4, query_scale=24 ** -0.5,
                          layer_types=("sliding", "full", "sliding")),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "llama_tied_llama3_rope": "LlamaForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gemma3": "Gemma3ForCausalLM"}


def random_params(config, seed=0):
    """Random params with norms around 1 and non-zero biases, so every tensor matters."""
    params = init_params(config, jax.random.key(seed), std=0.25)
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        name = path[-1].key
        if name.endswith("norm"):
            return x + 0.1 * rng.standard_normal(x.shape).astype(np.float32)
        if name in ("bq", "bk", "bv"):
            return 0.1 * rng.standard_normal(x.shape).astype(np.float32)
        return x
    return jax.tree.map_with_path(perturb, jax.device_get(params))


def tiny_tokenizer(vocab_size=VOCAB):
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")


def jax_logits(params, config, tokens_BxS):
    B, S = tokens_BxS.shape
    positions = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    logits, _ = jax.jit(forward, static_argnames="config")(
        params, config, tokens_BxS, positions, init_cache(config, B, S))
    return np.asarray(logits)


def torch_logits(model, tokens_BxS):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens_BxS)).logits.numpy()


def load_transformers(path):
    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                       output_loading_info=True)
    # Nothing silently left at its random initialisation, nothing ignored.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def assert_same_params(a, b):
    flat_a, tree_a = jax.tree.flatten_with_path(a)
    flat_b, tree_b = jax.tree.flatten_with_path(b)
    assert tree_a == tree_b
    for (path, x), (_, y) in zip(flat_a, flat_b):
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 10)).astype(np.int32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_loads_in_transformers_with_same_logits(name, tmp_path):
    config = CONFIGS[name]
    params = random_params(config)
    out = hf.export_hf_dir(params, config, tmp_path / "hf", tokenizer=tiny_tokenizer())
    model = load_transformers(out)
    assert type(model).__name__ == HF_CLASSES[name]
    want = jax_logits(params, config, TOKENS)
    assert np.abs(want).max() > 1.0
    assert np.max(np.abs(torch_logits(model, TOKENS) - want)) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_loads_back_identically(name, tmp_path):
    config = CONFIGS[name]
    params = random_params(config, seed=1)
    out = hf.export_hf_dir(params, config, tmp_path / "hf", tokenizer=tiny_tokenizer())
    loaded = jaxspec.load(out)
    assert loaded.config == config
    assert_same_params(loaded.params, params)
    # jaxspec loads the tokenizer transformers would load from the directory.
    ids = AutoTokenizer.from_pretrained(str(out))("w5 w7 w3")["input_ids"]
    assert loaded.tokenizer("w5 w7 w3")["input_ids"] == ids
    if name != "qwen2":  # transformers 5 rebuilds a generic tokenizer under a qwen2 config as
        assert ids == [5, 7, 3]  # a byte-level Qwen2Tokenizer, which cannot read a WordLevel one


def test_store_round_trip(tmp_path):
    config = CONFIGS["gemma3"]
    params = random_params(config, seed=2)
    path = store.save(tmp_path / "ckpt", params, config, tiny_tokenizer(), extra={"note": "x"})
    assert store.is_checkpoint(path) and not (tmp_path / "ckpt.tmp").exists()
    got_config, got_params, meta = store.restore(path)
    assert got_config == config and meta["note"] == "x" and meta["dtype"] == "float32"
    assert_same_params(got_params, params)
    assert store.load_tokenizer(path)("w9 w4")["input_ids"] == [9, 4]
    model = jaxspec.load(path)  # a jaxspec checkpoint directory is loadable by path
    assert model.config == config and model.tokenizer is not None
    assert_same_params(model.params, params)
    # Saving again over an existing checkpoint replaces it.
    params2 = random_params(config, seed=3)
    store.save(path, params2, config)
    assert_same_params(store.restore(path)[1], params2)
    assert store.load_tokenizer(path) is None


def test_store_restores_onto_a_sharding(tmp_path):
    config = CONFIGS["llama"]
    params = random_params(config, seed=4)
    store.save(tmp_path / "ckpt", params, config)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    # The embedding sharded on its vocab axis, everything else replicated.
    shardings = jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.P()), params)
    shardings["embed"] = jax.sharding.NamedSharding(mesh, jax.P("data", None))
    _, got, _ = store.restore(tmp_path / "ckpt", shardings=shardings)
    assert_same_params(got, params)
    for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(shardings)):
        assert leaf.sharding == want
    _, bf16, meta = store.restore(tmp_path / "ckpt", dtype=jax.numpy.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jax.numpy.dtype("bfloat16")}


def test_sharded_safetensors_directory(tmp_path):
    config = CONFIGS["qwen2"]
    params = random_params(config, seed=5)
    state = hf.hf_state_from_params(params, config)
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    out = tmp_path / "sharded"
    out.mkdir()
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.nbytes for v in state.values())},
         "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(hf.hf_config_from_config(config)))
    tiny_tokenizer().save_pretrained(str(out))

    got_config, got_params = hf.load_hf_dir(out)
    assert got_config == config
    assert_same_params(got_params, params)
    assert_same_params(jaxspec.load(out).params, params)
    model = load_transformers(out)
    assert np.max(np.abs(torch_logits(model, TOKENS) - jax_logits(params, config, TOKENS))) < 1e-4


def test_untied_head_equal_to_embedding_stays_tied(tmp_path):
    """A checkpoint that stores lm_head equal to the embedding loads as tied; a different one
    loads untied even when config.json claims tied embeddings."""
    config = CONFIGS["llama_tied_llama3_rope"]
    params = random_params(config, seed=6)
    out = hf.export_hf_dir(params, config, tmp_path / "hf")
    state = hf.hf_state_from_params(params, config)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].copy()
    save_file(state, str(out / "model.safetensors"))
    assert hf.load_hf_dir(out)[0].tie_embeddings
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    save_file(state, str(out / "model.safetensors"))
    got_config, got_params = hf.load_hf_dir(out)
    assert not got_config.tie_embeddings
    np.testing.assert_array_equal(got_params["lm_head"], state["lm_head.weight"])


def test_tokenizer_round_trips_through_export(tmp_path):
    tok = tiny_tokenizer()
    hf.export_hf_dir(random_params(CONFIGS["llama"]), CONFIGS["llama"], tmp_path / "hf", tok)
    again = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert again("w3 w60 w12")["input_ids"] == tok("w3 w60 w12")["input_ids"] == [3, 60, 12]


def test_reduced_head_export_fails_before_writing(tmp_path):
    """transformers has no subset head: the export says so and leaves no partial directory."""
    from jaxspec.training import drafter_init

    config = CONFIGS["llama"]
    reduced, params = drafter_init.reduce_head(config, random_params(config), np.arange(16))
    with pytest.raises(ValueError, match="reduced-vocabulary head has no Hugging Face"):
        hf.export_hf_dir(params, reduced, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
