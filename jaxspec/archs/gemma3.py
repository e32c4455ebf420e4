"""Gemma 3 (text): scaled embeddings, QK-norm, norms after attention and MLP, GeGLU, and
interleaved sliding-window layers with their own rope base."""

from jaxspec.archs.base import LAYER_NAMES, QK_NORM_NAMES, Arch, hf_rope, rope_scaling
from jaxspec.errors import UserError

PATTERN = 6  # every sixth layer attends globally
# transformers' Gemma3TextConfig defaults: the vision models' config.json gives only what
# differs from them in its text_config.
TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                 "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                 "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
                 "query_pre_attn_scalar": 256, "sliding_window": 4096}


def from_hf(hf: dict, head_dim: int) -> dict:
    rope = hf.get("rope_parameters") or {}
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    layer_types = tuple("sliding" if t == "sliding_attention" else "full"
                        for t in hf.get("layer_types") or ())
    if not layer_types:
        pattern = hf.get("sliding_window_pattern", PATTERN)
        layer_types = tuple("full" if (i + 1) % pattern == 0 else "sliding"
                            for i in range(hf["num_hidden_layers"]))
    if hf.get("attention_bias"):
        raise UserError("Gemma 3 checkpoints with attention_bias are not supported")
    if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
        raise UserError("logit soft-capping is not supported (Gemma 3 does not use it)")
    return dict(
        arch="gemma3",
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
        rope_scaling=rope_scaling(full or hf.get("rope_scaling")),
        rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
        sliding_window=hf.get("sliding_window"), layer_types=layer_types,
        query_scale=float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def to_hf(c, out: dict) -> dict:
    # transformers validates query_pre_attn_scalar as an int.
    scalar = (c.query_scale or c.head_dim ** -0.5) ** -2
    if abs(scalar - round(scalar)) > 1e-6 * scalar:
        raise UserError(f"query_scale={c.query_scale} is not 1/sqrt of an integer, which "
                        f"Gemma3's query_pre_attn_scalar must be")
    scaling, full = hf_rope(c)
    return {**out, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": c.sliding_window,
            "layer_types": ["sliding_attention" if s else "full_attention"
                            for s in c.sliding_layers],
            "query_pre_attn_scalar": round(scalar),
            "rope_theta": c.rope_theta, "rope_local_base_freq": c.rope_local_theta,
            "rope_scaling": scaling,
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


def from_gguf(meta, need, head_dim: int, tensors: set) -> dict:
    n = int(need("block_count"))
    return dict(arch="gemma3", rope_local_theta=10000.0,
                sliding_window=int(need("attention.sliding_window")),
                layer_types=tuple("full" if (i + 1) % PATTERN == 0 else "sliding"
                                  for i in range(n)),
                query_scale=head_dim ** -0.5)


ARCH = Arch(
    name="gemma3", hf_types=("gemma3_text", "gemma3"), gguf_types=("gemma3",),
    layer_names={**LAYER_NAMES, **QK_NORM_NAMES,
                 "post_attn_norm": "post_attention_layernorm.weight",
                 "mlp_norm": "pre_feedforward_layernorm.weight",
                 "post_mlp_norm": "post_feedforward_layernorm.weight"},
    from_hf=from_hf, to_hf=to_hf, from_gguf=from_gguf, embed_scale=True, qk_norm=True,
    sandwich_norms=True, norm_offset=1.0, activation="gelu_tanh")
