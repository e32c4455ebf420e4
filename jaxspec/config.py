"""Frozen, hashable configuration objects, loadable from YAML with `key=value` overrides."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import yaml

from jaxspec import archs
from jaxspec.errors import UserError


class _Loader(yaml.SafeLoader):
    """YAML with 1.2's numbers: PyYAML follows YAML 1.1, where "3e-4" (no dot) is text."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def _yaml(text):
    return yaml.load(text, Loader=_Loader)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling: "linear" (factor) or "llama3" (factor, low/high freq factors)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer; `arch` names its table in `jaxspec.archs`."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Sliding-window layers (Gemma 3) use their own rope base and no scaling.
    rope_local_theta: float = 10000.0
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full" or "sliding"; empty means all full
    query_scale: float | None = None  # None: head_dim ** -0.5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    # A head over a subset of the vocabulary (drafters): its size; the embedding stays full.
    head_vocab_size: int | None = None
    max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self):
        archs.get(self.arch)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise UserError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_heads={self.num_heads} is not a multiple of "
                            f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise UserError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.head_vocab_size is not None and self.tie_embeddings:
            raise UserError("a reduced head_vocab_size needs an untied lm_head")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise UserError(f"layer_types has {len(self.layer_types)} entries for "
                                f"{self.num_layers} layers")
            bad = set(self.layer_types) - {"full", "sliding"}
            if bad:
                raise UserError(f"unknown layer types {sorted(bad)}; use 'full' or 'sliding'")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise UserError("sliding layers need a positive sliding_window")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        return tuple(t == "sliding" for t in self.layer_types) or (False,) * self.num_layers

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for k in ("layer_types", "eos_token_ids"):
            if k in d:
                d[k] = tuple(d[k])
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise UserError(f"unknown ModelConfig keys: {sorted(unknown)}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A vision-language target's image side (Gemma 3): a SigLIP vision encoder over square
    images of `image_size` pixels cut into patches of `patch_size`, pooled to
    `tokens_per_image` embeddings, projected to the decoder's width; and the image's ids in
    the text: `image_token_id` holds one embedding's place, `boi_token_id` and `eoi_token_id`
    open and close an image."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        side = self.image_size // self.patch_size
        pooled = round(self.tokens_per_image ** 0.5)
        if self.image_size % self.patch_size or pooled ** 2 != self.tokens_per_image \
                or side % pooled or self.hidden_size % self.num_heads:
            raise UserError(f"vision config: {self.image_size}px images in "
                            f"{self.patch_size}px patches do not pool to "
                            f"{self.tokens_per_image} tokens (a square number dividing the "
                            f"patch grid), or {self.num_heads} heads do not divide "
                            f"{self.hidden_size}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def parse_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": 1}, "c": "x"}`; values are parsed as YAML where they
    parse, else kept as text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise UserError(f"override {pair!r} is not of the form key=value")
        key, value = pair.split("=", 1)
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        try:
            node[leaf] = _yaml(value)
        except yaml.YAMLError:  # e.g. a template such as "Q: {prompt}": keep the text
            node[leaf] = value
    return out


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; `update` wins."""
    out = dict(base)
    for k, v in update.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """A YAML file (optional) with `key=value` overrides applied on top."""
    base: dict[str, Any] = {}
    if path:
        with open(path) as f:
            base = _yaml(f) or {}
        if not isinstance(base, dict):
            raise UserError(f"{path}: expected a mapping at the top level")
    return merge(base, parse_overrides(overrides))
