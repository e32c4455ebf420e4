"""What an architecture is to jaxspec: the forward pass's flags, its weight names, and how its
configs read from and write to Hugging Face and GGUF. One `Arch` per file in this package."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxspec.errors import UserError

# jaxspec layer param -> its Hugging Face name under model.layers.{i}.
LAYER_NAMES = {
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
QK_NORM_NAMES = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
BIASES = ("bq", "bk", "bv")


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture. `from_hf(config_json, head_dim)` and `from_gguf(meta, need, head_dim,
    tensor_names)` give the ModelConfig fields it owns (`meta(key, default)` and `need(key)` read
    `{gguf type}.key`); `to_hf(config, fields)` completes a config.json from the fields every
    architecture shares."""

    name: str
    hf_types: tuple[str, ...]  # transformers' model_type values it loads
    gguf_types: tuple[str, ...]  # GGUF general.architecture values it loads
    layer_names: Mapping[str, str]  # jaxspec layer param -> Hugging Face name (biases optional)
    from_hf: Callable[[dict, int], dict]
    to_hf: Callable[[Any, dict], dict]
    from_gguf: Callable[[Callable, Callable, int, set], dict]
    gguf_permuted: tuple[str, ...] = ()  # GGUF types whose q/k rows llama.cpp permuted
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    qk_norm: bool = False  # RMSNorm of each query and key head before rope
    sandwich_norms: bool = False  # norms after attention and after the MLP too
    norm_offset: float = 0.0  # checkpoints store the norm multiplier minus this
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"


def rope_scaling(d: dict | None) -> dict | None:
    """A Hugging Face rope scaling dict -> RopeScaling fields (None: no scaling)."""
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return dict(kind="linear", factor=float(d["factor"]))
    if kind == "llama3":
        return dict(kind="llama3", factor=float(d["factor"]),
                    low_freq_factor=float(d["low_freq_factor"]),
                    high_freq_factor=float(d["high_freq_factor"]),
                    original_max_position=int(d["original_max_position_embeddings"]))
    raise UserError(f"unsupported rope scaling {kind!r}")


def hf_rope(c) -> tuple[dict | None, dict]:
    """(rope_scaling, rope_parameters) of config.json for a config's global rope."""
    scaling = None
    if c.rope_scaling:
        s = c.rope_scaling
        scaling = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                           original_max_position_embeddings=s.original_max_position)
    return scaling, {"rope_type": "default", "rope_theta": c.rope_theta, **(scaling or {})}


def hf_theta(hf: dict, default: float = 10000.0) -> tuple[float, dict | None]:
    """(rope theta, scaling dict) of a Llama-style config.json, transformers 4 or 5 layout."""
    rope = hf.get("rope_parameters") or {}
    scaling = rope if "rope_type" in rope else hf.get("rope_scaling")
    return float(rope.get("rope_theta", hf.get("rope_theta", default))), scaling


def refuse_biases(hf: dict, mtype: str) -> None:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        # attention_bias also biases o_proj, mlp_bias the MLP: jaxspec has neither.
        raise UserError(f"{mtype} checkpoints with attention_bias or mlp_bias are not "
                        f"supported (jaxspec biases q/k/v only, as Qwen2 does)")
