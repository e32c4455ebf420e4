"""jaxspec: fast multilingual LLM inference with speculative decoding and specialised drafters."""

from jaxspec.config import ModelConfig
from jaxspec.loading import Model, load, score

__all__ = ["Model", "ModelConfig", "load", "score"]
