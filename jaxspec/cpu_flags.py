"""XLA:CPU settings that keep speculative decoding bit-exact.

On x86 CPUs with FMA, XLA:CPU contracts multiply-adds in fused elementwise code differently for
different row counts, so a verify pass over several positions and a step over one round
differently and greedy output can change at a near-tie (bfloat16 weights: 1-2 answers in 40).
Capping XLA's code generation at AVX (256-bit vectors, no FMA) makes every row of a forward
independent of how many rows run with it; measured cost: none (the weight products run in
YNNPACK/Eigen, not in generated code). Set JAXSPEC_CPU_FMA=1 to keep XLA's default.
"""

from __future__ import annotations

import os
import platform
import warnings

FLAG = "--xla_cpu_max_isa=AVX"


def applies() -> bool:
    return (platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get("JAXSPEC_CPU_FMA") != "1")


def set_exact_cpu_flags() -> None:
    """Add FLAG to XLA_FLAGS unless the user set `xla_cpu_max_isa`; warn when JAX's backends
    already started without it (the flag is read once, at start)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not applies() or "xla_cpu_max_isa" in flags:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        warnings.warn("jaxspec was imported after JAX started, so XLA:CPU keeps FMA contraction: "
                      "speculative output may differ from plain greedy decoding at near-ties. "
                      f"Import jaxspec first, or set XLA_FLAGS={FLAG}.", stacklevel=3)
        return
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
