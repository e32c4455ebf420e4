"""Spec-Bench JSONL I/O: `question.jsonl` prompts and `model_answer` records.

An answer record (one JSON object a line, Spec-Bench's format, lists are per turn):

    {"question_id": 81, "category": "writing", "model_id": "jaxspec-eagle",
     "choices": [{"index": 0, "turns": ["..."], "new_tokens": [212], "wall_time": [3.1],
                  "accept_lengths": [3, 1, 4, ...]}],
     "tstamp": 1717000000.0}

`accept_lengths` is flat over all turns of the choice; each entry is the number of tokens one
target step emitted (accepted drafts plus the bonus/correction token). An optional top-level
`"gamma"` (draft length, positive int) is kept for the speedup-vs-gamma plot.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from jaxspec.errors import UserError
from jaxspec.files import read_jsonl

PathLike = str | os.PathLike[str]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _is_id(x: Any) -> bool:
    return _is_int(x) or isinstance(x, str)


def _question_problem(obj: Any) -> str | None:
    """What is wrong with a question object, or None if it is valid."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for key in ("question_id", "category", "turns"):
        if key not in obj:
            return f"missing field {key!r}"
    if not _is_id(obj["question_id"]):
        return "'question_id' must be an int or a string"
    if not isinstance(obj["category"], str):
        return "'category' must be a string"
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return "'turns' must be a non-empty list of strings"
    images = obj.get("images", [])
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        return "'images' must be a list of image file paths"
    return None


def _choice_problem(choice: Any) -> str | None:
    """What is wrong with one entry of an answer's `choices`, or None if it is valid."""
    if not isinstance(choice, dict):
        return "each choice must be a JSON object"
    for key in ("index", "turns", "new_tokens", "wall_time", "accept_lengths"):
        if key not in choice:
            return f"choice is missing field {key!r}"
    turns, new_tokens, wall_time = choice["turns"], choice["new_tokens"], choice["wall_time"]
    if not _is_int(choice["index"]):
        return "choice 'index' must be an int"
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return "choice 'turns' must be a non-empty list of strings"
    if not isinstance(new_tokens, list) or not all(_is_int(n) and n >= 0 for n in new_tokens):
        return "choice 'new_tokens' must be a list of non-negative ints"
    if not isinstance(wall_time, list) or not all(_is_number(t) and t > 0 for t in wall_time):
        return "choice 'wall_time' must be a list of positive finite numbers"
    if not len(turns) == len(new_tokens) == len(wall_time):
        return (
            f"choice has {len(turns)} turns, {len(new_tokens)} new_tokens and "
            f"{len(wall_time)} wall_time entries; they must match"
        )
    accept = choice["accept_lengths"]
    if not isinstance(accept, list) or not accept or not all(_is_int(a) and a >= 1 for a in accept):
        return "choice 'accept_lengths' must be a non-empty list of ints >= 1"
    return None


def _answer_problem(obj: Any) -> str | None:
    """What is wrong with an answer record, or None if it is valid."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    for key in ("question_id", "category", "model_id", "choices", "tstamp"):
        if key not in obj:
            return f"missing field {key!r}"
    if not _is_id(obj["question_id"]):
        return "'question_id' must be an int or a string"
    if not isinstance(obj["category"], str) or not isinstance(obj["model_id"], str):
        return "'category' and 'model_id' must be strings"
    if not _is_number(obj["tstamp"]):
        return "'tstamp' must be a finite number"
    if "gamma" in obj and not (obj["gamma"] == "auto" or _is_int(obj["gamma"])
                               and obj["gamma"] >= 1):
        return "'gamma' must be a positive int or 'auto'"
    choices = obj["choices"]
    if not isinstance(choices, list) or not choices:
        return "'choices' must be a non-empty list"
    for choice in choices:
        problem = _choice_problem(choice)
        if problem is not None:
            return problem
    return None


def read_questions(path: PathLike) -> list[dict]:
    """Read a Spec-Bench `question.jsonl`; blank lines are ignored, anything malformed raises."""
    questions: list[dict] = []
    seen: dict[Any, int] = {}
    for lineno, obj in read_jsonl(path):
        problem = _question_problem(obj)
        if problem is not None:
            raise UserError(f"{path}:{lineno}: {problem}")
        qid = obj["question_id"]
        if qid in seen:
            raise UserError(
                f"{path}:{lineno}: duplicate question_id {qid!r} (first on line {seen[qid]})"
            )
        seen[qid] = lineno
        questions.append(obj)
    if not questions:
        raise UserError(f"{path}: no questions (file is empty)")
    return questions


def read_answers(path: PathLike) -> list[dict]:
    """Read a Spec-Bench `model_answer` JSONL; blank lines are ignored, anything malformed raises.

    The one exception is an unterminated last line that is not valid JSON: the trace of a run
    killed mid-write. It is dropped with a warning.
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")  # the last element is the unterminated tail ("" if none)
    records: list[dict] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines):
                warnings.warn(
                    f"{path}:{lineno}: dropping truncated last line (run killed mid-write?)",
                    stacklevel=2,
                )
                break
            raise UserError(f"{path}:{lineno}: invalid JSON ({err.msg})") from err
        problem = _answer_problem(obj)
        if problem is not None:
            raise UserError(f"{path}:{lineno}: {problem}")
        records.append(obj)
    return records


def done_question_ids(path: PathLike) -> set[int | str]:
    """Ids of the questions already answered in `path` (empty if it does not exist), to resume."""
    if not Path(path).exists():
        return set()
    return {record["question_id"] for record in read_answers(path)}


def _encode(record: dict, where: str) -> str:
    problem = _answer_problem(record)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return json.dumps(record, ensure_ascii=False) + "\n"


def _end_previous_line(path: Path) -> None:
    """Make `path` end with a newline: terminate a valid last line, cut a truncated one."""
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        start = data.rfind(b"\n") + 1
        if not data[start:].strip():
            f.truncate(start)
            return
        try:
            json.loads(data[start:])
        except json.JSONDecodeError:
            warnings.warn(f"{path}: cutting truncated last line before appending", stacklevel=3)
            f.truncate(start)
            return
        f.write(b"\n")


def append_answer(path: PathLike, record: dict) -> None:
    """Append one answer record to `path`, flushed and fsynced so a killed run loses nothing."""
    path = Path(path)
    line = _encode(record, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        _end_previous_line(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_references(path: PathLike) -> dict[Any, str]:
    """Reference translations: JSONL lines `{"question_id": ..., "reference": "..."}`."""
    refs: dict[Any, str] = {}
    for lineno, obj in read_jsonl(path):
        if not isinstance(obj, dict) or not _is_id(obj.get("question_id")) \
                or not isinstance(obj.get("reference"), str):
            raise UserError(f"{path}:{lineno}: expected {{\"question_id\", \"reference\"}}")
        refs[obj["question_id"]] = obj["reference"]
    return refs


def image_paths(questions: PathLike, question: dict) -> list[str]:
    """A question's images, as paths (they are written relative to its question file)."""
    return [str(Path(questions).parent / p) for p in question.get("images", [])]
