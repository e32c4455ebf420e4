"""Hugging Face layout <-> jaxspec params and config; HF directory load and export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxspec.config import ModelConfig, RopeScaling
from jaxspec.errors import UserError

# jaxspec layer param -> (HF name under model.layers.{i}., kind)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_LLAMA_NAMES = {**_LAYER_NAMES, "mlp_norm": "post_attention_layernorm.weight"}
_GEMMA_NAMES = {
    **_LAYER_NAMES,
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}


def layer_names(config: ModelConfig) -> dict[str, str]:
    names = _GEMMA_NAMES if config.arch == "gemma3" else _LLAMA_NAMES
    if not config.qkv_bias:
        names = {k: v for k, v in names.items() if k not in ("bq", "bk", "bv")}
    return names


def _norm_offset(config: ModelConfig) -> float:
    """Gemma stores w and multiplies by 1 + w; jaxspec stores the multiplier."""
    return 1.0 if config.arch == "gemma3" else 0.0


def _to_jax(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """One HF tensor (torch layout: Linear weight is [out, in]) -> jaxspec layout."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    if name == "wq":
        return w.T.reshape(D, N, H)
    if name in ("wk", "wv"):
        return w.T.reshape(D, K, H)
    if name == "wo":
        return w.T.reshape(N, H, D)
    if name == "bq":
        return w.reshape(N, H)
    if name in ("bk", "bv"):
        return w.reshape(K, H)
    if name in ("w_gate", "w_up", "w_down"):
        return w.T
    if name.endswith("norm"):
        return w + _norm_offset(c)
    raise KeyError(name)


def _to_hf(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    if name in ("wq", "wk", "wv"):
        return w.reshape(c.hidden_size, -1).T
    if name == "wo":
        return w.reshape(-1, c.hidden_size).T
    if name in ("bq", "bk", "bv"):
        return w.reshape(-1)
    if name in ("w_gate", "w_up", "w_down"):
        return w.T
    if name.endswith("norm"):
        return w - _norm_offset(c)
    raise KeyError(name)


def params_from_hf_state(get, config: ModelConfig, dtype=np.float32, progress=None,
                         place=None) -> dict:
    """Build params from HF-named tensors; `get(name) -> np.ndarray` (KeyError if absent).
    `place(path, array)` (e.g. onto a mesh) takes each param as soon as it is converted, path
    being its keys in the params, e.g. ("layers", 3, "wq")."""
    put = place or (lambda path, w: w)

    def fetch(name):
        try:
            return np.asarray(get(name), dtype=np.float32)
        except KeyError:
            raise UserError(f"checkpoint has no tensor {name!r}") from None

    names = layer_names(config)
    layers = []
    for i in range(config.num_layers):
        layers.append({ours: put(("layers", i, ours), _to_jax(
            ours, fetch(f"model.layers.{i}.{hf}"), config).astype(dtype, copy=False))
            for ours, hf in names.items()})
        if progress:
            progress(i + 1, config.num_layers)
    params = {
        "embed": put(("embed",), fetch("model.embed_tokens.weight").astype(dtype, copy=False)),
        "layers": layers,
        "final_norm": put(("final_norm",), (fetch("model.norm.weight")
                                            + _norm_offset(config)).astype(dtype, copy=False)),
    }
    if not config.tie_embeddings:
        params["lm_head"] = put(("lm_head",), fetch("lm_head.weight").T.astype(dtype, copy=False))
    return params


def hf_state_from_params(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    state = {"model.embed_tokens.weight": params["embed"],
             "model.norm.weight": np.asarray(params["final_norm"]) - _norm_offset(config)}
    if not config.tie_embeddings:
        state["lm_head.weight"] = np.asarray(params["lm_head"]).T
    for i, lp in enumerate(params["layers"]):
        for ours, hf in layer_names(config).items():
            state[f"model.layers.{i}.{hf}"] = _to_hf(ours, np.asarray(lp[ours], np.float32), config)
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in state.items()}


def _rope_scaling(d: dict | None) -> RopeScaling | None:
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(d["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(d["factor"]), float(d["low_freq_factor"]),
                           float(d["high_freq_factor"]),
                           int(d["original_max_position_embeddings"]))
    raise UserError(f"unsupported rope scaling {kind!r}")


_LLAMA_TYPES = ("llama", "mistral", "qwen2")


def config_from_hf(hf: dict) -> ModelConfig:
    """A transformers config.json dict -> ModelConfig."""
    if "text_config" in hf:  # multimodal wrapper (e.g. Gemma3ForConditionalGeneration)
        hf = {**hf["text_config"], "model_type": hf["text_config"].get("model_type", "gemma3_text")}
    mtype = hf.get("model_type")
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    common = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=hf.get("max_position_embeddings", 8192),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos,
        pad_token_id=hf.get("pad_token_id") or 0,
    )
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    if mtype in _LLAMA_TYPES:
        if hf.get("hidden_act", "silu") != "silu":
            raise UserError(f"unsupported activation {hf['hidden_act']!r} for {mtype}")
        if mtype == "mistral" and hf.get("sliding_window"):
            raise UserError("Mistral checkpoints with a sliding window are not supported")
        if mtype != "qwen2" and (hf.get("attention_bias") or hf.get("mlp_bias")):
            # Llama's attention_bias also biases o_proj, mlp_bias the MLP: jaxspec has neither.
            raise UserError(f"{mtype} checkpoints with attention_bias or mlp_bias are not "
                            f"supported (jaxspec biases q/k/v only, as Qwen2 does)")
        scaling = rope if "rope_type" in rope else hf.get("rope_scaling")
        return ModelConfig(
            arch="llama", head_dim=head_dim, **common,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(scaling),
            tie_embeddings=bool(hf.get("tie_word_embeddings", mtype != "qwen2")),
            qkv_bias=mtype == "qwen2")
    if mtype in ("gemma3_text", "gemma3"):
        full = rope.get("full_attention", {}) if rope else {}
        local = rope.get("sliding_attention", {}) if rope else {}
        layer_types = tuple("sliding" if t == "sliding_attention" else "full"
                            for t in hf.get("layer_types") or ())
        if not layer_types:
            pattern = hf.get("sliding_window_pattern", 6)
            layer_types = tuple("full" if (i + 1) % pattern == 0 else "sliding"
                                for i in range(hf["num_hidden_layers"]))
        if hf.get("attention_bias"):
            raise UserError("Gemma 3 checkpoints with attention_bias are not supported")
        if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
            raise UserError("logit soft-capping is not supported (Gemma 3 does not use it)")
        return ModelConfig(
            arch="gemma3", head_dim=head_dim, **common,
            rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
            rope_scaling=_rope_scaling(full or hf.get("rope_scaling")),
            rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
            sliding_window=hf.get("sliding_window"), layer_types=layer_types,
            query_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)))
    raise UserError(f"unknown architecture {mtype!r}: jaxspec loads {_LLAMA_TYPES} and gemma3")


def hf_config_from_config(c: ModelConfig) -> dict:
    """ModelConfig -> a config.json that transformers loads as Llama/Gemma3ForCausalLM."""
    if c.head_vocab_size is not None:
        raise UserError("a reduced-vocabulary head has no Hugging Face equivalent")
    out = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_eps,
        "max_position_embeddings": c.max_position, "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": c.bos_token_id, "pad_token_id": c.pad_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
        "torch_dtype": "float32",
    }
    scaling = None
    if c.rope_scaling:
        s = c.rope_scaling
        scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                           original_max_position_embeddings=s.original_max_position)
    if c.arch == "llama":
        rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(scaling or {})}
        common = {**out, "hidden_act": "silu", "rope_theta": c.rope_theta,
                  "rope_scaling": scaling, "rope_parameters": rope}
        if c.qkv_bias:  # Llama's attention_bias would add an o_proj bias: q/k/v bias is Qwen2
            return {**common, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                    "use_sliding_window": False}
        return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "attention_bias": False, "mlp_bias": False}
    # transformers validates query_pre_attn_scalar as an int.
    scalar = (c.query_scale or c.head_dim ** -0.5) ** -2
    if abs(scalar - round(scalar)) > 1e-6 * scalar:
        raise UserError(f"query_scale={c.query_scale} is not 1/sqrt of an integer, which "
                        f"Gemma3's query_pre_attn_scalar must be")
    return {**out, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": c.sliding_window,
            "layer_types": ["sliding_attention" if s else "full_attention"
                            for s in c.sliding_layers],
            "query_pre_attn_scalar": round(scalar),
            "rope_theta": c.rope_theta, "rope_local_base_freq": c.rope_local_theta,
            "rope_scaling": scaling,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta,
                                   **(scaling or {})},
                "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


def load_hf_dir(path: str | os.PathLike, dtype=np.float32, progress=None, place=None):
    """(config, params) from a directory with config.json and *.safetensors (sharded or not);
    `place(config)` may give a per-param placer (see `params_from_hf_state`)."""
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    config = config_from_hf(json.loads(cfg_file.read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    index = {}
    handles = [safe_open(str(f), framework="numpy") for f in files]
    for h in handles:
        for k in h.keys():
            index[k] = h
    if config.tie_embeddings and "lm_head.weight" in index and "model.embed_tokens.weight" in index:
        config = config.replace(tie_embeddings=False) if not np.array_equal(
            index["lm_head.weight"].get_tensor("lm_head.weight"),
            index["model.embed_tokens.weight"].get_tensor("model.embed_tokens.weight")) else config

    def get(name):
        # Multimodal checkpoints nest the text model under language_model.
        for full in (name, name.replace("model.", "model.language_model.", 1),
                     "language_model." + name):
            if full in index:
                return index[full].get_tensor(full)
        raise KeyError(name)

    return config, params_from_hf_state(get, config, dtype, progress,
                                        place(config) if place else None)


def export_hf_dir(params: dict, config: ModelConfig, path: str | os.PathLike,
                  tokenizer=None) -> Path:
    """Write config.json, model.safetensors (and the tokenizer) for transformers to load."""
    from safetensors.numpy import save_file

    hf_config = hf_config_from_config(config)  # checked before anything is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = hf_state_from_params(jax.device_get(params), config)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
