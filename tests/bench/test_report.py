"""Spec-Bench speed report against numbers computed by hand."""

import csv
import json
import sys

import pytest

from jaxspec.bench.report import chrf_bleu, report, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(qid, category, new_tokens, wall_time, accept_lengths, gamma=None):
    record = {
        "question_id": qid,
        "category": category,
        "model_id": "m",
        "choices": [
            {
                "index": 0,
                "turns": ["t"] * len(new_tokens),
                "new_tokens": new_tokens,
                "wall_time": wall_time,
                "accept_lengths": accept_lengths,
            }
        ],
        "tstamp": 0.0,
    }
    if gamma is not None:
        record["gamma"] = gamma
    return record


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# Baseline (autoregressive): accept_lengths = [1] * new_tokens.
#   q1 writing: (10 + 20) / (1.0 + 2.0) = 10 tok/s
#   q2 writing: 8 / 2.0 = 4 tok/s
#   q3 math:    12 / 4.0 = 3 tok/s
BASELINE = [
    _record(1, "writing", [10, 20], [1.0, 2.0], [1] * 30),
    _record(2, "writing", [8], [2.0], [1] * 8),
    _record(3, "math", [12], [4.0], [1] * 12),
]
# Speculative, gamma 4:
#   q1 writing: (10 + 20) / (0.5 + 1.0) = 20 tok/s, accepts 4 4 2 | 5 5 5 5
#   q2 writing: 8 / 1.0 = 8 tok/s, accepts 5 3
#   q3 math:    12 / 1.5 = 8 tok/s, accepts 4 4 4
SPEC = [
    _record(1, "writing", [10, 20], [0.5, 1.0], [4, 4, 2, 5, 5, 5, 5], gamma=4),
    _record(2, "writing", [8], [1.0], [5, 3], gamma=4),
    _record(3, "math", [12], [1.5], [4, 4, 4], gamma=4),
]


def test_summarize_matches_hand_arithmetic():
    s = summarize(BASELINE, SPEC)
    overall = s["overall"]
    assert overall["baseline_tokens_per_s"] == pytest.approx((10 + 4 + 3) / 3)
    assert overall["tokens_per_s"] == pytest.approx((20 + 8 + 8) / 3)
    assert overall["speedup"] == pytest.approx(12 / (17 / 3))  # = 36 / 17
    # all 12 accept entries: 4+4+2+5+5+5+5 + 5+3 + 4+4+4 = 50
    assert overall["tau"] == pytest.approx(50 / 12)
    assert overall["num_questions"] == 3


def test_answers_identical_to_the_baseline_are_counted():
    differs = json.loads(json.dumps(SPEC))
    differs[1]["choices"][0]["turns"] = ["another text"]
    s = summarize(BASELINE, differs)
    assert s["overall"]["identical"] == 2
    assert s["by_category"]["writing"]["identical"] == 1
    assert s["by_category"]["math"]["identical"] == 1
    assert summarize(BASELINE, SPEC)["overall"]["identical"] == 3


def test_summarize_per_category():
    by_cat = summarize(BASELINE, SPEC)["by_category"]
    assert list(by_cat) == ["math", "writing"]
    writing, math = by_cat["writing"], by_cat["math"]
    assert writing["baseline_tokens_per_s"] == pytest.approx((10 + 4) / 2)
    assert writing["tokens_per_s"] == pytest.approx((20 + 8) / 2)
    assert writing["speedup"] == pytest.approx(14 / 7)
    assert writing["tau"] == pytest.approx(38 / 9)
    assert writing["num_questions"] == 2
    assert math["speedup"] == pytest.approx(8 / 3)
    assert math["tau"] == pytest.approx(12 / 3)
    assert math["num_questions"] == 1


def test_autoregressive_baseline_against_itself():
    overall = summarize(BASELINE, BASELINE)["overall"]
    assert overall["speedup"] == pytest.approx(1.0)
    assert overall["tau"] == 1.0


def test_mismatched_questions_use_intersection_and_warn():
    # the method lacks q3 and has an extra q4 the baseline never answered
    method = SPEC[:2] + [_record(4, "math", [5], [1.0], [5])]
    with pytest.warns(UserWarning, match="dropped 1 questions only the baseline .* and 1 only"):
        s = summarize(BASELINE, method, name="spec")
    # over q1, q2 only: baseline (10 + 4) / 2 = 7, method (20 + 8) / 2 = 14
    assert s["overall"]["speedup"] == pytest.approx(2.0)
    assert s["overall"]["tau"] == pytest.approx(38 / 9)
    assert s["overall"]["num_questions"] == 2
    assert list(s["by_category"]) == ["writing"]


def test_no_overlap_raises():
    with pytest.raises(ValueError, match="spec: no questions in common"):
        summarize(BASELINE[:1], SPEC[1:], name="spec")


def test_duplicate_and_inconsistent_records_raise():
    with pytest.raises(ValueError, match="duplicate question_id 1"):
        summarize(BASELINE, SPEC + SPEC[:1])
    relabeled = [{**SPEC[0], "category": "math"}, *SPEC[1:]]
    with pytest.raises(ValueError, match="question 1 is 'math' here but 'writing'"):
        summarize(BASELINE, relabeled)


def _is_png(path):
    data = path.read_bytes()
    return len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC)


def test_report_writes_markdown_csv_and_plots(tmp_path):
    # a second speculative run with gamma 2: q1 30 / 2.0 = 15, q2 8 / 2.0 = 4, q3 12 / 2.0 = 6
    spec2 = [
        _record(1, "writing", [10, 20], [1.0, 1.0], [2, 3, 3, 2, 3, 3, 3, 3, 3, 2, 3], gamma=2),
        _record(2, "writing", [8], [2.0], [3, 3, 2], gamma=2),
        _record(3, "math", [12], [2.0], [3, 3, 3, 3], gamma=2),
    ]
    files = {
        "ar": _write(tmp_path / "ar.jsonl", BASELINE),
        "spec_g4": _write(tmp_path / "g4.jsonl", SPEC),
        "spec_g2": _write(tmp_path / "g2.jsonl", spec2),
    }
    out = tmp_path / "report"
    summaries = report(files, baseline="ar", out_dir=out)

    assert list(summaries) == ["ar", "spec_g4", "spec_g2"]
    assert summaries["spec_g4"]["overall"]["speedup"] == pytest.approx(36 / 17)
    # spec_g2: (15 + 4 + 6) / 3 = 25 / 3 tok/s; speedup (25 / 3) / (17 / 3) = 25 / 17
    assert summaries["spec_g2"]["overall"]["speedup"] == pytest.approx(25 / 17)
    # 11 + 3 + 4 = 18 entries summing to 30 + 8 + 12 = 50
    assert summaries["spec_g2"]["overall"]["tau"] == pytest.approx(50 / 18)

    md = (out / "report.md").read_text()
    assert "| ar | 5.67 | 1.000x | 1.000 | 3 |" in md
    assert "| spec_g4 | 12.00 | 2.118x | 4.167 | 3 |" in md  # 36/17, 50/12
    assert "| spec_g4 | writing | 14.00 | 2.000x | 4.222 | 2 |" in md  # 38/9
    assert "| spec_g4 | math | 8.00 | 2.667x | 4.000 | 1 |" in md

    with open(out / "report.csv", newline="") as f:
        rows = {(r["method"], r["category"]): r for r in csv.DictReader(f)}
    assert len(rows) == 3 * 3  # overall + 2 categories, for each of 3 methods
    assert float(rows["spec_g4", "overall"]["speedup"]) == pytest.approx(36 / 17)
    assert float(rows["spec_g4", "math"]["tau"]) == pytest.approx(4.0)
    assert int(rows["spec_g2", "writing"]["num_questions"]) == 2

    for name in ("tokens_per_s.png", "accept_lengths.png", "speedup_vs_gamma.png"):
        assert _is_png(out / name), name
        assert f"]({name})" in md


def test_report_skips_gamma_plot_with_one_gamma(tmp_path):
    files = {"ar": _write(tmp_path / "ar.jsonl", BASELINE), "spec": _write(tmp_path / "s.jsonl", SPEC)}
    report(files, baseline="ar", out_dir=tmp_path)
    assert _is_png(tmp_path / "tokens_per_s.png")
    assert _is_png(tmp_path / "accept_lengths.png")
    assert not (tmp_path / "speedup_vs_gamma.png").exists()


def test_report_rejects_unknown_baseline_and_mixed_gamma(tmp_path):
    with pytest.raises(ValueError, match="baseline 'ar' is not among"):
        report({"spec": _write(tmp_path / "s.jsonl", SPEC)}, baseline="ar", out_dir=tmp_path)
    mixed = SPEC[:2] + [{**SPEC[2], "gamma": 2}]
    files = {"ar": _write(tmp_path / "ar.jsonl", BASELINE), "m": _write(tmp_path / "m.jsonl", mixed)}
    with pytest.raises(ValueError, match=r"m: answers mix gamma values \[2, 4\]"):
        report(files, baseline="ar", out_dir=tmp_path)


def test_chrf_bleu_perfect_and_imperfect():
    pytest.importorskip("sacrebleu")
    refs = ["the cat sat on the mat", "a quick brown fox jumps"]
    perfect = chrf_bleu(refs, refs)
    assert perfect["chrf"] == pytest.approx(100.0)
    assert perfect["bleu"] == pytest.approx(100.0)
    worse = chrf_bleu(["the dog sat on a rug", "a slow red fox runs"], refs)
    assert 0.0 < worse["chrf"] < 100.0
    assert worse["bleu"] < 100.0
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        chrf_bleu(refs, refs[:1])


def test_chrf_bleu_without_sacrebleu_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # makes `import sacrebleu` fail
    with pytest.raises(ImportError, match="pip install sacrebleu"):
        chrf_bleu(["a"], ["a"])


def test_report_scores_quality_against_references(tmp_path):
    from jaxspec.questions import read_references

    def texts(records, words):
        return [{**r, "choices": [{**r["choices"][0],
                                   "turns": [w] * len(r["choices"][0]["turns"])}]}
                for r, w in zip(records, words)]

    good = ["the cat sat on the mat", "a dog runs in the park", "it rains all day long"]
    worse = ["the cat sat on a hat", "no dog here", "it rains all day long"]
    base = _write(tmp_path / "ar.jsonl", texts(BASELINE, good))
    spec = _write(tmp_path / "spec.jsonl", texts(SPEC, worse))
    refs_file = tmp_path / "refs.jsonl"
    refs_file.write_text("".join(json.dumps({"question_id": i + 1, "reference": g}) + "\n"
                                 for i, g in enumerate(good)))
    summaries = report({"ar": base, "spec": spec}, "ar", tmp_path / "out",
                       read_references(refs_file))
    assert summaries["ar"]["overall"]["chrf"] == pytest.approx(100.0)
    assert summaries["ar"]["overall"]["bleu"] == pytest.approx(100.0)
    expected = chrf_bleu(worse, good)
    assert expected["chrf"] < 90
    assert summaries["spec"]["overall"]["chrf"] == pytest.approx(expected["chrf"])
    assert summaries["spec"]["overall"]["bleu"] == pytest.approx(expected["bleu"])
    assert "## Quality against references" in (tmp_path / "out" / "report.md").read_text()


def test_references_file_errors_name_the_line(tmp_path):
    from jaxspec.questions import read_references

    f = tmp_path / "refs.jsonl"
    f.write_text('{"question_id": 1, "reference": "a"}\n{"question_id": 2}\n')
    with pytest.raises(ValueError, match=r"refs.jsonl:2:"):
        read_references(f)
