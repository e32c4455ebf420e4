"""Hugging Face layout <-> jaxspec params and config; HF directory load and export."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxspec import archs
from jaxspec.config import ModelConfig, VisionConfig
from jaxspec.errors import UserError
from jaxspec.models.params import layer_params


def layer_names(config: ModelConfig) -> dict[str, str]:
    """jaxspec layer param -> its Hugging Face name under model.layers.{i}."""
    names = archs.get(config.arch).layer_names
    return {ours: names[ours] for ours in layer_params(config)}


def _norm_offset(config: ModelConfig) -> float:
    """What checkpoints leave out of the norm multiplier jaxspec stores (Gemma's 1 + w)."""
    return archs.get(config.arch).norm_offset


def _to_jax(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """One HF tensor (torch layout: Linear weight is [out, in]) -> jaxspec layout."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    if name == "wq":
        return w.reshape(N, H, D)
    if name in ("wk", "wv"):
        return w.reshape(K, H, D)
    if name == "wo":
        return w.reshape(D, N, H)
    if name == "bq":
        return w.reshape(N, H)
    if name in ("bk", "bv"):
        return w.reshape(K, H)
    if name in ("w_gate", "w_up", "w_down"):
        return w
    if name.endswith("norm"):
        return w + _norm_offset(c)
    raise KeyError(name)


def _to_hf(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    if name in ("wq", "wk", "wv"):
        return w.reshape(-1, c.hidden_size)
    if name == "wo":
        return w.reshape(c.hidden_size, -1)
    if name in ("bq", "bk", "bv"):
        return w.reshape(-1)
    if name in ("w_gate", "w_up", "w_down"):
        return w
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
        params["lm_head"] = put(("lm_head",), fetch("lm_head.weight").astype(dtype, copy=False))
    return params


def hf_state_from_params(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    state = {"model.embed_tokens.weight": params["embed"],
             "model.norm.weight": np.asarray(params["final_norm"]) - _norm_offset(config)}
    if not config.tie_embeddings:
        state["lm_head.weight"] = np.asarray(params["lm_head"])
    for i, lp in enumerate(params["layers"]):
        for ours, hf in layer_names(config).items():
            state[f"model.layers.{i}.{hf}"] = _to_hf(ours, np.asarray(lp[ours], np.float32), config)
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in state.items()}


def config_from_hf(hf: dict) -> ModelConfig:
    """A transformers config.json dict -> ModelConfig."""
    if "text_config" in hf:  # multimodal wrapper (e.g. Gemma3ForConditionalGeneration)
        from jaxspec.archs.gemma3 import TEXT_DEFAULTS

        outer = {k: hf[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id") if k in hf}
        text = {**outer, **hf["text_config"]}
        defaults = TEXT_DEFAULTS if hf.get("model_type") == "gemma3" else {}
        hf = {**defaults, **text, "model_type": text.get("model_type", "gemma3_text")}
    arch = archs.for_hf(hf.get("model_type"))
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    common = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=head_dim, intermediate_size=hf["intermediate_size"],
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position=hf.get("max_position_embeddings", 8192),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos,
        pad_token_id=hf.get("pad_token_id") or 0,
    )
    return ModelConfig.from_dict({**common, **arch.from_hf(hf, head_dim)})


_SIGLIP = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
               num_attention_heads=12, image_size=224, patch_size=16)  # transformers' defaults
_VISION_LAYER = {"ln1": "layer_norm1.weight", "ln1_b": "layer_norm1.bias",
                 "wq": "self_attn.q_proj.weight", "bq": "self_attn.q_proj.bias",
                 "wk": "self_attn.k_proj.weight", "bk": "self_attn.k_proj.bias",
                 "wv": "self_attn.v_proj.weight", "bv": "self_attn.v_proj.bias",
                 "wo": "self_attn.out_proj.weight", "bo": "self_attn.out_proj.bias",
                 "ln2": "layer_norm2.weight", "ln2_b": "layer_norm2.bias",
                 "w1": "mlp.fc1.weight", "b1": "mlp.fc1.bias",
                 "w2": "mlp.fc2.weight", "b2": "mlp.fc2.bias"}


def vision_config_from_hf(hf: dict) -> VisionConfig | None:
    """The image side of a vision-language config.json (Gemma 3's), None for a text model."""
    if "vision_config" not in hf:
        return None
    if hf.get("model_type") != "gemma3":
        raise UserError(f"vision-language model_type {hf.get('model_type')!r} is not supported "
                        f"(jaxspec runs Gemma 3's)")
    v = {**_SIGLIP, **(hf["vision_config"] or {})}
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UserError(f"vision activation {v['hidden_act']!r} is not supported")
    return VisionConfig(
        hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
        image_size=v["image_size"], patch_size=v["patch_size"],
        tokens_per_image=hf.get("mm_tokens_per_image", 256),
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 262144)),
        boi_token_id=hf.get("boi_token_index", hf.get("boi_token_id", 255999)),
        eoi_token_id=hf.get("eoi_token_index", hf.get("eoi_token_id", 256000)),
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)))


def vision_params_from_hf_state(get, vc: VisionConfig, dtype=np.float32) -> dict:
    """The image side's params from HF-named tensors (`get` as in `params_from_hf_state`;
    names under vision_tower., with or without vision_model., and multi_modal_projector.)."""
    def fetch(name):
        for full in (name, "model." + name, name.replace("vision_tower.",
                                                         "vision_tower.vision_model.", 1)):
            try:
                return np.asarray(get(full), np.float32)
            except KeyError:
                pass
        raise UserError(f"checkpoint has no tensor {name!r}")

    tower = "vision_tower."
    layers = [{ours: fetch(f"{tower}encoder.layers.{i}.{hf}").astype(dtype)
               for ours, hf in _VISION_LAYER.items()} for i in range(vc.num_layers)]
    patch = fetch(tower + "embeddings.patch_embedding.weight")
    return {
        "patch": patch.reshape(patch.shape[0], -1).astype(dtype),
        "patch_b": fetch(tower + "embeddings.patch_embedding.bias").astype(dtype),
        "position": fetch(tower + "embeddings.position_embedding.weight").astype(dtype),
        "layers": layers,
        "post_ln": fetch(tower + "post_layernorm.weight").astype(dtype),
        "post_ln_b": fetch(tower + "post_layernorm.bias").astype(dtype),
        "mm_norm": (fetch("multi_modal_projector.mm_soft_emb_norm.weight") + 1).astype(dtype),
        "mm_proj": fetch("multi_modal_projector.mm_input_projection_weight").T.astype(dtype),
    }


def hf_config_from_config(c: ModelConfig) -> dict:
    """ModelConfig -> a config.json that transformers loads as its architecture's ForCausalLM."""
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
    return archs.get(c.arch).to_hf(c, out)


def _tensor_index(path: Path) -> dict:
    """Tensor name -> the open safetensors file holding it, over a directory's *.safetensors."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    index = {}
    for f in files:
        h = safe_open(str(f), framework="numpy")
        for k in h.keys():
            index[k] = h
    return index


def load_hf_vision(path: str | os.PathLike, dtype=np.float32):
    """(VisionConfig, its params, `images.Preprocess`) of a vision-language HF directory; None
    for a text model."""
    from jaxspec.images import Preprocess

    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    vc = vision_config_from_hf(hf)
    if vc is None:
        return None
    index = _tensor_index(path)
    params = vision_params_from_hf_state(lambda n: index[n].get_tensor(n), vc, dtype)
    pre_file = path / "preprocessor_config.json"
    pre = json.loads(pre_file.read_text()) if pre_file.exists() else {}
    return vc, params, Preprocess.from_hf(pre, vc.image_size)


def load_hf_dir(path: str | os.PathLike, dtype=np.float32, progress=None, place=None):
    """(config, params) from a directory with config.json and *.safetensors (sharded or not);
    `place(config)` may give a per-param placer (see `params_from_hf_state`)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json")
    config = config_from_hf(json.loads(cfg_file.read_text()))
    index = _tensor_index(path)
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
