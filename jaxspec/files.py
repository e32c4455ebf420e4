"""File helpers shared by long jobs and caches."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from jaxspec.errors import UserError


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a killed process leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
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
