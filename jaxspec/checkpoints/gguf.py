"""GGUF -> (ModelConfig, params, tokenizer), through the `gguf` package."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxspec import archs
from jaxspec.checkpoints import gguf_reader, hf
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str, arch: archs.Arch) -> str | None:
    """GGUF tensor name -> Hugging Face name (None for tensors jaxspec does not use)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4:
        return None
    _, i, kind, suffix = parts
    if kind == "ffn_norm":  # the norm before the MLP, whatever the architecture calls it
        base = arch.layer_names["mlp_norm"].removesuffix(".weight")
    elif kind in _BLOCK_NAMES:
        base = _BLOCK_NAMES[kind]
    else:
        return None
    return f"model.layers.{i}.{base}.{suffix}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows [n_head * head_dim, ...])."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_ROWS = 8192  # rows dequantised at a time


class GGUFError(UserError):
    pass


def _open(path: Path) -> gguf_reader.GGUFFile:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != gguf_reader.MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (bad magic bytes)")
    try:
        return gguf_reader.read(path)
    except Exception as e:  # a truncated file fails in many ways
        raise GGUFError(f"{path} is a corrupt or truncated GGUF file: {e}") from e


def _field(reader, key, default=None):
    return reader.fields.get(key, default)


def _arch(reader) -> tuple[str, archs.Arch]:
    """The file's general.architecture and the table that loads it."""
    name = _field(reader, "general.architecture")
    arch = archs.for_gguf(name)
    if arch is None:
        raise GGUFError(f"unknown GGUF architecture {name!r}: jaxspec loads "
                        f"{tuple(t for a in archs.ARCHS.values() for t in a.gguf_types)}")
    return name, arch


def config_from_gguf(reader) -> ModelConfig:
    name, arch = _arch(reader)

    def g(key, default=None):
        return _field(reader, f"{name}.{key}", default)

    def need(key):
        value = g(key)
        if value is None:
            raise GGUFError(f"GGUF metadata has no {name}.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(g("attention.key_length", g("rope.dimension_count", hidden // heads)))
    tensors = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise GGUFError("GGUF files with precomputed rope_freqs (Llama 3.1 rope scaling) are not "
                        "supported; load the Hugging Face directory instead")
    unsupported = {"blk.0.attn_output.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias"} & tensors
    if unsupported:
        raise GGUFError(f"GGUF tensors {sorted(unsupported)} are not supported: jaxspec has "
                        f"biases on q/k/v only")
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise GGUFError("GGUF metadata has no tokenizer.ggml.tokens (the vocabulary)")
    vocab = len(reader.fields["tokenizer.ggml.tokens"])
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    scaling = None
    if g("rope.scaling.type") == "linear":
        scaling = dict(kind="linear", factor=float(g("rope.scaling.factor")))
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_layers=int(need("block_count")),
        num_heads=heads, num_kv_heads=int(g("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position=int(g("context_length", 8192)),
        tie_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", 0)))
    return ModelConfig.from_dict({**common, **arch.from_gguf(g, need, head_dim, tensors)})


def load_gguf(path: str | os.PathLike, dtype=np.float32, progress=None, place=None):
    """(config, params) from a GGUF file, dequantised to float32 and cast to `dtype`; `place`
    as for `hf.load_hf_dir`.

    `progress(done, total)` is called as tensors are dequantised.
    """
    import gguf

    path = Path(path)
    reader = _open(path)
    config = config_from_gguf(reader)
    kind, arch = _arch(reader)
    permuted = kind in arch.gguf_permuted
    by_name = {name: t for t in reader.tensors if (name := _hf_name(t.name, arch)) is not None}
    done = 0

    def get(name):  # dequantised when asked for: one float32 tensor at a time beside the params
        nonlocal done
        t = by_name[name]
        rows = t.data.reshape(-1, t.data.shape[-1])
        w = np.empty((rows.shape[0], int(t.shape[0])), np.float32)
        try:  # in blocks of rows: dequantize's temporaries stay small
            for i in range(0, len(rows), _ROWS):
                w[i:i + _ROWS] = gguf.quants.dequantize(rows[i:i + _ROWS], t.tensor_type)
        except Exception as e:
            raise GGUFError(f"{path}: cannot dequantise tensor {t.name} "
                            f"({t.tensor_type.name}): {e}") from e
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = config.num_heads if "q_proj" in name else config.num_kv_heads
            w = _unpermute(w, n)
        if name.endswith("norm.weight"):
            w = w - arch.norm_offset  # llama.cpp stores the multiplier (Gemma's 1 + w)
        done += 1
        if progress:
            progress(done, len(by_name))
        return w

    return config, hf.params_from_hf_state(get, config, dtype,
                                           place=place(config) if place else None)


_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer `AutoTokenizer.from_pretrained(dir, gguf_file=...)` builds, from metadata
    read here: transformers' own GGUF tokenizer converter, without its GGUF file reader (which
    imports torch, a test-only dependency)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    fields = _open(Path(path)).fields
    grouped = {group: {name: fields[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in fields}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    spec, kwargs = grouped["tokenizer"], grouped["tokenizer_config"]
    if spec.get("tokenizer_type") == "llama":  # llama.cpp's default for sentencepiece files
        kwargs.setdefault("add_bos_token", True)
    for name, key in _SPECIAL.items():
        token_id = fields.get(f"tokenizer.ggml.{key}")
        kwargs[name] = spec["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(fields["general.architecture"], spec)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs, **extra)
