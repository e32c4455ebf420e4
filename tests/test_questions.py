"""Spec-Bench question / model_answer JSONL I/O."""

import json

import pytest

from jaxspec.questions import (
    append_answer,
    done_question_ids,
    read_answers,
    read_questions,
)


def _answer(qid: int, tokens: int = 4) -> dict:
    return {
        "question_id": qid,
        "category": "writing",
        "model_id": "m",
        "choices": [
            {
                "index": 0,
                "turns": ["x"],
                "new_tokens": [tokens],
                "wall_time": [0.5],
                "accept_lengths": [1] * tokens,
            }
        ],
        "tstamp": 1.0,
    }


def test_read_questions_skips_blank_lines(tmp_path):
    path = tmp_path / "question.jsonl"
    q1 = {"question_id": 81, "category": "writing", "turns": ["a", "b"]}
    q2 = {"question_id": 82, "category": "math", "turns": ["c"]}
    path.write_text(json.dumps(q1) + "\n\n   \n" + json.dumps(q2) + "\n")
    assert read_questions(path) == [q1, q2]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question_id": 3, "category": "math", "turns": ["x"]', "invalid JSON"),
        ('{"question_id": 3, "category": "math"}', "missing field 'turns'"),
        ('{"question_id": 3, "category": "math", "turns": []}', "non-empty list of strings"),
        ('{"question_id": 3, "category": "math", "turns": ["a", 2]}', "non-empty list of strings"),
        ('{"question_id": 3, "category": "math", "turns": "abc"}', "non-empty list of strings"),
        ('{"question_id": 1.5, "category": "math", "turns": ["x"]}', "'question_id'"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"question_id": 1, "category": "math", "turns": ["x"]}', "duplicate question_id 1"),
    ],
)
def test_read_questions_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "question.jsonl"
    good = json.dumps({"question_id": 1, "category": "writing", "turns": ["hi"]})
    path.write_text(good + "\n\n" + bad_line + "\n")  # the bad line is line 3
    with pytest.raises(ValueError, match="question.jsonl:3: ") as info:
        read_questions(path)
    assert message in str(info.value)


def test_read_questions_empty_file_is_an_error(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="no questions"):
        read_questions(path)


def test_append_then_read_answers_round_trips(tmp_path):
    path = tmp_path / "out" / "ans.jsonl"
    records = [_answer(1), {**_answer(2), "gamma": 4}, {**_answer(3), "gamma": "auto"}]
    for r in records:
        append_answer(path, r)
    assert read_answers(path) == records
    assert path.read_text().count("\n") == 3
    with pytest.raises(ValueError, match="positive int or 'auto'"):
        append_answer(path, {**_answer(4), "gamma": "fast"})


def test_append_answer_and_resume(tmp_path):
    path = tmp_path / "ans.jsonl"
    assert done_question_ids(path) == set()
    append_answer(path, _answer(1))
    append_answer(path, _answer(2))
    assert done_question_ids(path) == {1, 2}
    assert [r["question_id"] for r in read_answers(path)] == [1, 2]


def test_truncated_last_line_is_dropped_with_warning_and_resume_continues(tmp_path):
    path = tmp_path / "ans.jsonl"
    append_answer(path, _answer(1))
    append_answer(path, _answer(2))
    partial = json.dumps(_answer(3))[:40]  # a kill in the middle of writing question 3
    with open(path, "a") as f:
        f.write(partial)

    with pytest.warns(UserWarning, match="ans.jsonl:3: dropping truncated last line"):
        assert done_question_ids(path) == {1, 2}

    with pytest.warns(UserWarning, match="cutting truncated last line"):
        append_answer(path, _answer(3))
    assert [r["question_id"] for r in read_answers(path)] == [1, 2, 3]
    assert path.read_text().count("\n") == 3  # the partial line is gone, not glued to q3


def test_complete_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "ans.jsonl"
    path.write_text(json.dumps(_answer(1)))
    assert done_question_ids(path) == {1}
    append_answer(path, _answer(2))
    assert [r["question_id"] for r in read_answers(path)] == [1, 2]


def test_malformed_middle_answer_line_raises(tmp_path):
    path = tmp_path / "ans.jsonl"
    path.write_text(json.dumps(_answer(1)) + "\n{broken\n" + json.dumps(_answer(2)) + "\n")
    with pytest.raises(ValueError, match="ans.jsonl:2: invalid JSON"):
        read_answers(path)


def test_invalid_answer_fields_raise(tmp_path):
    path = tmp_path / "ans.jsonl"
    bad = _answer(1)
    bad["choices"][0]["wall_time"] = [0.5, 0.5]  # two times for one turn
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="ans.jsonl:1: choice has 1 turns"):
        read_answers(path)
    with pytest.raises(ValueError, match="they must match"):
        append_answer(tmp_path / "other.jsonl", bad)
    assert not (tmp_path / "other.jsonl").exists()
    with pytest.raises(ValueError, match="other.jsonl: missing field 'tstamp'"):
        append_answer(tmp_path / "other.jsonl",
                      {k: v for k, v in _answer(1).items() if k != "tstamp"})
