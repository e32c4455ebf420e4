"""File helpers shared by long jobs and caches."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a killed process leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def parse_jsonl(text: str) -> list:
    """One JSON value per non-empty line. Lines end at "\n" only: `str.splitlines` also breaks at
    U+2028, U+0085 and other characters a JSON string may hold raw (distilled text does)."""
    return [json.loads(line) for line in text.split("\n") if line.strip()]
