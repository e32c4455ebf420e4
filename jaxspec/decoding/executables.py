"""Compiled decode loops on disk, found without tracing them.

JAX's persistent cache (`xla_cache`) keys an executable by its lowered program, so a warm
process still traces and lowers the whole loop before it can look (most of a warm demo's
compile time). Here an executable is keyed by what produces that program: the function, its
static settings, its arguments' structure, shapes and dtypes, jaxspec's source, and the jax,
backend and flags it was compiled by. A key that misses, or an entry that cannot be read
(rebuilt with a one-line warning), falls back to compiling; an executable JAX cannot serialize
is not stored. Functions that donate their arguments are not kept: XLA:CPU sometimes reads an
executable back without all its functions ("Function ... not found" at its first run), and
`Checked` then compiles afresh and calls again, which needs the arguments intact; such a key is
marked and compiled through JAX's persistent cache from then on.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import serialize_executable

from jaxspec.files import cache_dir, warn_rebuild, write_atomic

FORMAT = 1


@functools.cache
def _source_digest() -> str:
    """jaxspec's own code: any edit changes every key."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def entry(fn, statics: dict, args, donate: tuple[int, ...]) -> Path | None:
    """Where `fn` compiled for these statics and arguments is kept; None when the cache is off
    (JAXSPEC_COMPILATION_CACHE=0), `fn` donates arguments, they live on more than one device,
    the process is one of several (an executable is tied to its process's devices), or an
    executable read back for this key failed before (`Checked`)."""
    if (os.environ.get("JAXSPEC_COMPILATION_CACHE", "1") == "0" or donate
            or jax.process_count() > 1):
        return None
    leaves = jax.tree.leaves(args)
    devices = {d.id for a in leaves if hasattr(a, "sharding") for d in a.sharding.device_set}
    if len(devices) > 1:
        return None
    device = jax.devices()[0]
    parts = (fn.__module__, fn.__qualname__, sorted(statics.items()),
             jax.tree.structure(args), [(a.shape, str(a.dtype)) for a in leaves],
             _source_digest(), jax.__version__, jax.lib.__version__, sys.version,
             device.platform, device.device_kind, jax.device_count(), sorted(devices),
             os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64,
             jax.config.jax_default_matmul_precision)
    with np.printoptions(threshold=sys.maxsize):  # an array in a static setting, written whole
        key = hashlib.sha256(repr(parts).encode()).hexdigest()
    path = cache_dir("executables", FORMAT) / f"{fn.__name__}-{key[:32]}.pkl"
    return None if _broken(path).exists() else path


def _broken(path: Path) -> Path:
    return path.with_suffix(".broken")


def load(path: Path | None):
    """The executable kept at `path`, or None (absent, or unreadable: then dropped)."""
    if path is None or not path.exists():
        return None
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as err:  # any damage: compile afresh
        warn_rebuild("the compiled function", path, err)
        path.unlink(missing_ok=True)
        return None


def save(path: Path | None, compiled, seconds: float) -> None:
    """Keep `compiled` at `path`, written whole or not at all, if compiling it took as long as
    JAX's persistent cache asks (`jax_persistent_cache_min_compile_time_secs`)."""
    if path is None or seconds < jax.config.jax_persistent_cache_min_compile_time_secs:
        return
    try:
        data = pickle.dumps(serialize_executable.serialize(compiled))
    except (ValueError, NotImplementedError, TypeError, pickle.PicklingError):
        return  # not serializable (e.g. constants captured in the program)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)


class Checked:
    """An executable read back from `path`: if its first call finds functions missing, the entry
    is dropped and marked, and `rebuild()` (a fresh compile) serves this call and the rest."""

    def __init__(self, compiled, path: Path, rebuild):
        self.compiled, self.path, self.rebuild, self.checked = compiled, path, rebuild, False

    def __call__(self, *args):
        if self.checked:
            return self.compiled(*args)
        try:
            out = jax.block_until_ready(self.compiled(*args))
        except jax.errors.JaxRuntimeError as err:
            if "not found" not in str(err):
                raise
            warn_rebuild("the compiled function", self.path, err)
            self.path.unlink(missing_ok=True)
            _broken(self.path).touch()
            self.compiled = self.rebuild()
            out = self.compiled(*args)
        self.checked = True
        return out

    def as_text(self) -> str:
        return self.compiled.as_text()
