"""`Model`: what `jaxspec.load` returns and every decoding function takes."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec import sharding
from jaxspec.config import ModelConfig


@dataclasses.dataclass
class Model:
    """A loaded model: frozen config, param pytree, and tokenizer (None for bare random models);
    `mesh` and `rules` when its params are split over devices (`load(..., mesh=)`, `shard`);
    `vision` (a `vision.Vision`) when it also reads images."""

    config: ModelConfig
    params: dict
    tokenizer: Any = None
    name: str = ""
    mesh: Any = None
    rules: Any = None
    vision: Any = None

    def __post_init__(self):
        if self.mesh is not None and self.rules is None:
            self.rules = sharding.RULES
