"""Bad input gives a clear error (GGUFError / ValueError naming the problem), never a crash or
silently wrong numbers: corrupt and truncated GGUF files, unknown architectures, inconsistent
configs, out-of-vocabulary ids, sequences longer than the cache or the model, broken checkpoint
directories. And the precision `load` picks without a dtype (`native_dtype`): bfloat16 for both
embedded GGUF models, float32 for an all-float32 GGUF, a Hugging Face directory's torch_dtype, a
checkpoint's saved dtype."""

import json
import shutil

import gguf as gguf_pkg
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import loading
from jaxspec.checkpoints import gguf, hf, store
from jaxspec.checkpoints.gguf import GGUFError
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.models.cache import init_cache
from jaxspec.models.params import init_params
from jaxspec.models.transformer import forward

TINY = ModelConfig(arch="llama", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=8, intermediate_size=24, max_position=16)


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """Never read or write the user's conversion cache."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def smollm2_gguf():
    return loading.REGISTRY["smollm2-135m-instruct"]()


def _llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf q/k row permutation (HF -> GGUF)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, arch="llama", omit=(), seed=0):
    """A complete float32 GGUF of TINY's shape; `omit` drops metadata keys (without the
    `{arch}.` prefix). Returns the Hugging Face state it encodes."""
    c = TINY
    rng = np.random.default_rng(seed)
    D, F, N, K, H = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    state = {"model.embed_tokens.weight": rng.standard_normal((c.vocab_size, D)),
             "model.norm.weight": 1 + 0.1 * rng.standard_normal(D)}
    pre = "model.layers.0."
    state.update({
        pre + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(D),
        pre + "self_attn.q_proj.weight": rng.standard_normal((N * H, D)),
        pre + "self_attn.k_proj.weight": rng.standard_normal((K * H, D)),
        pre + "self_attn.v_proj.weight": rng.standard_normal((K * H, D)),
        pre + "self_attn.o_proj.weight": rng.standard_normal((D, N * H)),
        pre + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(D),
        pre + "mlp.gate_proj.weight": rng.standard_normal((F, D)),
        pre + "mlp.up_proj.weight": rng.standard_normal((F, D)),
        pre + "mlp.down_proj.weight": rng.standard_normal((D, F)),
    })
    state = {k: v.astype(np.float32) for k, v in state.items()}
    gguf_names = {
        "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "blk.0.attn_norm.weight": pre + "input_layernorm.weight",
        "blk.0.attn_q.weight": pre + "self_attn.q_proj.weight",
        "blk.0.attn_k.weight": pre + "self_attn.k_proj.weight",
        "blk.0.attn_v.weight": pre + "self_attn.v_proj.weight",
        "blk.0.attn_output.weight": pre + "self_attn.o_proj.weight",
        "blk.0.ffn_norm.weight": pre + "post_attention_layernorm.weight",
        "blk.0.ffn_gate.weight": pre + "mlp.gate_proj.weight",
        "blk.0.ffn_up.weight": pre + "mlp.up_proj.weight",
        "blk.0.ffn_down.weight": pre + "mlp.down_proj.weight",
    }
    w = gguf_pkg.GGUFWriter(str(path), arch)
    ints = {"block_count": c.num_layers, "context_length": c.max_position,
            "embedding_length": D, "feed_forward_length": F, "attention.head_count": N,
            "attention.head_count_kv": K}
    for key, value in ints.items():
        if key not in omit:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if "tokens" not in omit:
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, hf_name in gguf_names.items():
        t = state[hf_name]
        if name == "blk.0.attn_q.weight":
            t = _llama_cpp_permute(t, N)
        elif name == "blk.0.attn_k.weight":
            t = _llama_cpp_permute(t, K)
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


def test_tiny_gguf_control_loads_and_unpermutes(tmp_path):
    """The control for the broken files below: complete, it loads, and llama.cpp's q/k row
    permutation is undone exactly."""
    state = write_tiny_gguf(tmp_path / "tiny.gguf")
    config, params = gguf.load_gguf(tmp_path / "tiny.gguf")
    assert config.rms_eps == pytest.approx(1e-5) and config.num_heads == 2
    assert (config.vocab_size, config.num_kv_heads, config.tie_embeddings) == (32, 1, True)
    back = hf.hf_state_from_params(params, config)
    assert set(back) == set(state)
    for name, want in state.items():
        np.testing.assert_array_equal(back[name], want, err_msg=name)


@pytest.mark.parametrize("n_bytes", [3, 10, 24, 1000, 100_000, 3_000_000, "half", "all-but-1k"])
def test_truncated_gguf(smollm2_gguf, tmp_path, n_bytes):
    size = smollm2_gguf.stat().st_size
    n = {"half": size // 2, "all-but-1k": size - 1024}.get(n_bytes, n_bytes)
    bad = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as src:
        bad.write_bytes(src.read(n))
    with pytest.raises(GGUFError, match="truncated.gguf (is not a GGUF file|is a corrupt or "
                                        "truncated GGUF file)"):
        jaxspec.load(bad)
    assert not list((tmp_path / "cache").rglob("jaxspec.json"))  # nothing half-converted cached


def _corrupt(src, tmp_path, edit):
    with open(src, "rb") as f:
        data = bytearray(f.read(1 << 20))
    edit(data)
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    return bad


CORRUPTIONS = {
    "bad magic": lambda d: d.__setitem__(slice(0, 4), b"GGUX"),
    "version 99": lambda d: d.__setitem__(slice(4, 8), (99).to_bytes(4, "little")),
    "tensor count 2**62": lambda d: d.__setitem__(slice(8, 16), (2 ** 62).to_bytes(8, "little")),
    "key length 2**40": lambda d: d.__setitem__(slice(24, 32), (2 ** 40).to_bytes(8, "little")),
    "garbage header": lambda d: d.__setitem__(slice(24, 4096),
                                              np.random.default_rng(0).bytes(4072)),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_corrupt_gguf(smollm2_gguf, tmp_path, what):
    bad = _corrupt(smollm2_gguf, tmp_path, CORRUPTIONS[what])
    with pytest.raises(GGUFError, match="corrupt.gguf (is not a GGUF file|is a corrupt)"):
        jaxspec.load(bad)
    with pytest.raises(GGUFError):
        gguf.load_gguf(bad)


def test_version_is_named(smollm2_gguf, tmp_path):
    bad = _corrupt(smollm2_gguf, tmp_path, CORRUPTIONS["version 99"])
    with pytest.raises(GGUFError, match="version 99"):
        gguf.load_gguf(bad)


def test_unknown_gguf_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf_pkg.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_token_list(["a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="unknown GGUF architecture 'mamba'"):
        jaxspec.load(path)


@pytest.mark.parametrize("omit", ["attention.head_count", "embedding_length", "block_count",
                                  "feed_forward_length", "tokens"])
def test_gguf_missing_metadata(tmp_path, omit):
    write_tiny_gguf(tmp_path / "tiny.gguf", omit=(omit,))
    key = "tokenizer.ggml.tokens" if omit == "tokens" else f"llama.{omit}"
    with pytest.raises(GGUFError, match=f"GGUF metadata has no {key}"):
        gguf.load_gguf(tmp_path / "tiny.gguf")


def test_unknown_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "vocab_size": 50257, "hidden_size": 768, "num_hidden_layers": 12,
         "num_attention_heads": 12, "intermediate_size": 3072}))
    with pytest.raises(ValueError, match="unknown architecture 'gpt2'"):
        jaxspec.load(tmp_path)


def test_not_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a registered model"):
        jaxspec.load(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="neither config.json"):
        jaxspec.load(tmp_path)  # an empty directory
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="jaxspec loads .gguf files"):
        jaxspec.load(tmp_path / "weights.bin")


def test_loading_a_drafter_as_a_model_names_load_drafter(tmp_path):
    """A hidden-state drafter (shipped name or directory) is no model: the error names the call
    that loads it, with its target."""
    with pytest.raises(UserError, match=r"load_drafter\('gemma3-270m-deen-drafter', "
                       r"target=jaxspec\.load\('gemma3-270m'\)\)"):
        jaxspec.load("gemma3-270m-deen-drafter")
    head = tmp_path / "head"
    head.mkdir()
    (head / "head.json").write_text(json.dumps({"format": 1, "target": "smollm2-135m-instruct"}))
    with pytest.raises(UserError, match=r"hidden-state drafter.*load_drafter\(.*"
                       r"target=jaxspec\.load\('smollm2-135m-instruct'\)\)"):
        jaxspec.load(head)
    (head / "head.json").write_text("{not json")
    with pytest.raises(UserError, match="load_drafter"):
        jaxspec.load(head)


@pytest.mark.parametrize("kw, match", [
    (dict(num_heads=5, num_kv_heads=2), "num_heads=5 is not a multiple of num_kv_heads=2"),
    (dict(head_dim=7), "head_dim=7 must be even"),
    (dict(hidden_size=0), "hidden_size must be positive"),
    (dict(arch="gpt2"), "unknown architecture 'gpt2'"),
    (dict(layer_types=("full",) * 3), "layer_types has 3 entries for 1 layers"),
    (dict(layer_types=("sliding",)), "sliding layers need a positive sliding_window"),
])
def test_inconsistent_config(kw, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**kw)


def test_inconsistent_hf_config():
    cfg = {"model_type": "llama", "vocab_size": 32, "hidden_size": 20, "num_hidden_layers": 1,
           "num_attention_heads": 5, "num_key_value_heads": 2, "intermediate_size": 8}
    with pytest.raises(ValueError, match="num_heads=5 is not a multiple of num_kv_heads=2"):
        hf.config_from_hf(cfg)


def _tiny_model():
    return jaxspec.Model(TINY, init_params(TINY, jax.random.key(0)))


@pytest.mark.parametrize("bad_id", [32, 10 ** 6, -1])
def test_score_rejects_ids_outside_the_vocabulary(bad_id):
    with pytest.raises(ValueError, match=f"token id {bad_id} is outside the vocabulary"):
        jaxspec.score(_tiny_model(), [[1, 2, bad_id, 3]])


def test_score_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"must be \[batch, seq\]"):
        jaxspec.score(_tiny_model(), [1, 2, 3])
    with pytest.raises(ValueError, match="must be integers"):
        jaxspec.score(_tiny_model(), np.ones((1, 3), np.float32))


def test_sequence_longer_than_the_model():
    model = _tiny_model()
    assert jaxspec.score(model, np.ones((1, 16), np.int32)).shape == (1, 16, 32)
    with pytest.raises(ValueError, match="17 tokens exceeds the model's 16 positions"):
        jaxspec.score(model, np.ones((1, 17), np.int32))
    with pytest.raises(ValueError, match="exceeds the model's 16 positions"):
        jaxspec.generate(model, [list(range(1, 13))], max_new_tokens=8)


def test_sequence_longer_than_the_cache():
    params = init_params(TINY, jax.random.key(0))
    tokens = np.ones((1, 9), np.int32)
    positions = np.arange(9, dtype=np.int32)[None]
    with pytest.raises(ValueError, match="9 tokens do not fit a cache of 8 slots"):
        forward(params, TINY, tokens, positions, init_cache(TINY, 1, 8))


@pytest.fixture
def checkpoint(tmp_path):
    return store.save(tmp_path / "ckpt", init_params(TINY, jax.random.key(0)), TINY)


def test_checkpoint_control_loads(checkpoint):
    assert jaxspec.load(checkpoint).config == TINY


@pytest.mark.parametrize("damage, match", [
    (lambda p: (p / "jaxspec.json").write_text("{not json"), "not a readable jaxspec checkpoint"),
    (lambda p: (p / "jaxspec.json").write_text(json.dumps({"format": 99})), "format 99 is not 3"),
    (lambda p: shutil.rmtree(p / "params"), "cannot restore params"),
    (lambda p: [f.write_bytes(b"garbage") for f in (p / "params").rglob("*") if f.is_file()],
     "cannot restore params"),
])
def test_corrupt_checkpoint_directory(checkpoint, damage, match):
    damage(checkpoint)
    with pytest.raises(ValueError, match=match):
        jaxspec.load(checkpoint)


def test_checkpoint_config_disagreeing_with_params(checkpoint):
    meta = json.loads((checkpoint / "jaxspec.json").read_text())
    meta["config"]["intermediate_size"] = 40
    (checkpoint / "jaxspec.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="cannot restore params|has shape"):
        jaxspec.load(checkpoint)
    meta["config"].update(intermediate_size=24, num_heads=3, num_kv_heads=2)
    (checkpoint / "jaxspec.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        jaxspec.load(checkpoint)
    meta["config"]["surprise"] = 1
    (checkpoint / "jaxspec.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="unknown ModelConfig keys"):
        jaxspec.load(checkpoint)


def test_checkpoint_of_the_old_layout_loads_in_the_new(tmp_path):
    """A format-2 checkpoint (matrices saved [in, out], lm_head [embed, vocab]) restores into
    today's [out, in] layout with the same numbers."""
    import orbax.checkpoint as ocp

    config = TINY.replace(tie_embeddings=False)
    params = init_params(config, jax.random.key(1))
    old_layers = [{k: np.transpose(np.asarray(v), {2: (2, 0, 1), 1: (1, 0)}[v.ndim - 1])
                   if k in ("wq", "wk", "wv", "w_gate", "w_up", "w_down") else
                   (np.transpose(np.asarray(v), (1, 2, 0)) if k == "wo" else np.asarray(v))
                   for k, v in lp.items()} for lp in params["layers"]]
    old = {**params, "layers": old_layers, "lm_head": np.asarray(params["lm_head"]).T}
    path = store.save(tmp_path / "new", params, config)
    meta = json.loads((path / "jaxspec.json").read_text())
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "old" / "params", old)
    (tmp_path / "old" / "jaxspec.json").write_text(json.dumps({**meta, "format": 2}))
    got = jaxspec.load(tmp_path / "old", dtype="float32").params
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --- the default precision ----------------------------------------------------------------

def test_native_dtype_of_gguf_files():
    for name in ("smollm2-135m-instruct", "gemma3-270m"):  # Q4_1 and Q4_K_M: trained in bf16
        assert loading.native_dtype(loading.resolve(name)) == "bfloat16"


def test_all_float32_gguf_is_float32(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    assert loading.native_dtype(tmp_path / "tiny.gguf") == "float32"


@pytest.mark.parametrize("declared, want", [({"torch_dtype": "bfloat16"}, "bfloat16"),
                                            ({"dtype": "float16"}, "bfloat16"),
                                            ({"torch_dtype": "float32"}, "float32"),
                                            ({}, "float32")])
def test_hugging_face_config_declares_it(tmp_path, declared, want):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **declared}))
    assert loading.native_dtype(tmp_path) == want


def test_checkpoint_keeps_its_saved_dtype(tmp_path):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(TINY, jax.random.key(0)))
    path = store.save(tmp_path / "ckpt", params, TINY)
    assert jaxspec.load(path).params["embed"].dtype == jnp.bfloat16
    assert jaxspec.load(path, dtype="float32").params["embed"].dtype == jnp.float32
    drafter = jaxspec.load_drafter(path, target=jaxspec.load(path, dtype="float32"))
    assert drafter.params["model"]["embed"].dtype == jnp.float32  # a drafter takes its target's


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, int8"):
        jaxspec.load("gemma3-270m", dtype="float16")
