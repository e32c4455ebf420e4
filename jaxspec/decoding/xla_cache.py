"""JAX's persistent compilation cache under `$JAXSPEC_CACHE`, with damaged entries dropped.

JAX warns of an entry it cannot read and compiles afresh, but keeps the entry (it never writes
over an existing key), so every later process would pay the compile again; and it writes entries
in place, so a killed process can leave one truncated. `reading()` deletes such an entry with a
one-line warning: the next compile of that function writes it anew.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path

import jax

from jaxspec.files import cache_dir

FORMAT = 1  # JAX keys each entry by its program, jax version and flags
_UNREADABLE = "Error reading persistent compilation cache entry"
_LOG = "jax._src.lru_cache"  # logs "Cache hit for key: '<key>'" at debug level


def use() -> None:
    """Point JAX's persistent cache at `$JAXSPEC_CACHE/xla/...`, so a new process finds its
    executables on disk; off with JAXSPEC_COMPILATION_CACHE=0, and a directory the user
    configured is kept."""
    if os.environ.get("JAXSPEC_COMPILATION_CACHE", "1") == "0":
        return
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir("xla", FORMAT)))


class _Hits(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.keys: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Cache hit for key: "):
            self.keys.append(msg.removeprefix("Cache hit for key: ").strip("'\""))


@contextlib.contextmanager
def reading():
    """Compile inside this: an entry JAX read but could not use is deleted (see above)."""
    log, hits = logging.getLogger(_LOG), _Hits()
    level, propagate = log.level, log.propagate
    log.setLevel(logging.DEBUG)
    log.propagate = False
    log.addHandler(hits)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        log.removeHandler(hits)
        log.setLevel(level)
        log.propagate = propagate
    damaged = any(_UNREADABLE in str(w.message) for w in caught)
    for w in caught:
        if _UNREADABLE not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if damaged and hits.keys and jax.config.jax_compilation_cache_dir:
        path = Path(jax.config.jax_compilation_cache_dir) / f"{hits.keys[-1]}-cache"
        path.unlink(missing_ok=True)
        path.with_name(f"{hits.keys[-1]}-atime").unlink(missing_ok=True)
        print(f"jaxspec: the compiled function cached at {path} was unreadable; compiled it "
              f"afresh and dropped the entry (the next compile writes it again)",
              file=sys.stderr)
