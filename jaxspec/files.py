"""File helpers shared by long jobs and caches."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from jaxspec.errors import UserError


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` so that a killed process leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with (open(tmp, "wb") if isinstance(data, bytes) else open(tmp, "w", encoding="utf-8")) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_jsonl(path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) of each non-blank line; invalid JSON raises with the line.
    Lines end at "\n" only: `str.splitlines` also breaks at U+2028, U+0085 and other characters
    a JSON string may hold raw (distilled text does)."""
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{lineno}: invalid JSON ({err.msg})") from err


def cache_root() -> Path:
    """`$JAXSPEC_CACHE`, by default ~/.cache/jaxspec."""
    return Path(os.environ.get("JAXSPEC_CACHE", Path.home() / ".cache" / "jaxspec"))


def cache_dir(kind: str, fmt: int) -> Path:
    """The folder of one kind of cache entry, keyed by jaxspec's version and the entry's format,
    so that neither an older jaxspec's entries nor an older format is ever read."""
    return cache_root() / kind / f"jaxspec-{importlib.metadata.version('jaxspec')}-f{fmt}"


def warn_rebuild(what: str, path: Path, err: Exception) -> None:
    """The one-line warning for a cache entry that cannot be read and is built again."""
    print(f"jaxspec: {what} at {path} is unreadable ({type(err).__name__}: "
          f"{str(err).splitlines()[0] if str(err) else ''}); rebuilding it", file=sys.stderr)
