"""The architectures jaxspec runs, one table each; adding one is a file here and a line below."""

from jaxspec.archs import gemma3, llama, qwen3
from jaxspec.archs.base import Arch
from jaxspec.errors import UserError

ARCHS: dict[str, Arch] = {a.name: a for a in (llama.ARCH, gemma3.ARCH, qwen3.ARCH)}


def get(name: str) -> Arch:
    if name not in ARCHS:
        raise UserError(f"unknown architecture {name!r}; jaxspec supports {tuple(ARCHS)}")
    return ARCHS[name]


def for_hf(model_type: str) -> Arch:
    """The table that loads a transformers model_type."""
    for a in ARCHS.values():
        if model_type in a.hf_types:
            return a
    raise UserError(f"unknown architecture {model_type!r}: jaxspec loads "
                    f"{tuple(t for a in ARCHS.values() for t in a.hf_types)}")


def for_gguf(gguf_type: str) -> Arch | None:
    """The table that loads a GGUF general.architecture (None: none does)."""
    return next((a for a in ARCHS.values() if gguf_type in a.gguf_types), None)
