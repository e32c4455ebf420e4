"""jaxspec: fast multilingual LLM inference with speculative decoding and specialised drafters."""

from jaxspec.cpu_flags import set_exact_cpu_flags

set_exact_cpu_flags()  # before JAX starts: see jaxspec/cpu_flags.py

from jaxspec.config import ModelConfig
from jaxspec.drafters.model import layer_skip_drafter, model_drafter
from jaxspec.drafters.ngram import ngram_drafter
from jaxspec.drafters.hidden import hidden_drafter
from jaxspec.drafters.hybrid import hybrid_drafter
from jaxspec.drafters.lookahead import lookahead_drafter
from jaxspec.decoding.api import generate, speculative_generate
from jaxspec.decoding.runner import GenerationResult
from jaxspec.drafters.staged import staged_drafter
from jaxspec.decoding.routing import Router, detect_language
from jaxspec.loading import load, load_drafter, score
from jaxspec.models.model import Model

__all__ = ["GenerationResult", "Model", "ModelConfig", "Router", "detect_language", "generate",
           "hidden_drafter", "hybrid_drafter", "layer_skip_drafter", "load", "load_drafter",
           "lookahead_drafter", "model_drafter", "ngram_drafter", "score",
           "speculative_generate", "staged_drafter"]
