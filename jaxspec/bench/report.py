"""Spec-Bench speed report: tokens/s, speedup over a baseline and tau, overall and per category.

Same quantities as Spec-Bench's `evaluation/speed.py` (first choice of each answer):
  speed of a question = sum(new_tokens over turns) / sum(wall_time over turns);
  speedup = mean question speed of the method / that of the baseline, over common questions;
  tau = mean of all accept_lengths entries (tokens per target step, bonus token included);
  identical = questions whose answer text equals the baseline's (at temperature 0 with the same
  weights, speculative decoding must give every answer identical).
"""

from __future__ import annotations

import csv
import os
import statistics
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxspec.bench.plots import plot_accept_lengths, plot_speedup_vs_gamma, plot_tokens_per_s
from jaxspec.errors import UserError
from jaxspec.questions import read_answers

COLUMNS = ("tokens_per_s", "baseline_tokens_per_s", "speedup", "tau", "identical",
           "num_questions")


def question_speed(record: dict) -> float:
    """Tokens per second of one answer: all turns' new tokens over all turns' wall time."""
    choice = record["choices"][0]
    seconds = sum(choice["wall_time"])
    if seconds <= 0:
        raise UserError(f"question {record['question_id']!r}: total wall_time must be positive")
    return sum(choice["new_tokens"]) / seconds


def _by_id(records: Sequence[dict], who: str) -> dict[Any, dict]:
    out: dict[Any, dict] = {}
    for record in records:
        qid = record["question_id"]
        if qid in out:
            raise UserError(f"duplicate question_id {qid!r} in {who} answers")
        out[qid] = record
    return out


def _stats(baseline: list[dict], method: list[dict]) -> dict[str, float | int]:
    base_speed = statistics.fmean(question_speed(r) for r in baseline)
    speed = statistics.fmean(question_speed(r) for r in method)
    if base_speed == 0:
        raise UserError("baseline produced no tokens; speedup is undefined")
    accept = [a for r in method for a in r["choices"][0]["accept_lengths"]]
    return {
        "tokens_per_s": speed,
        "baseline_tokens_per_s": base_speed,
        "speedup": speed / base_speed,
        "tau": statistics.fmean(accept),
        "identical": sum(b["choices"][0]["turns"] == m["choices"][0]["turns"]
                         for b, m in zip(baseline, method)),
        "num_questions": len(method),
    }


def summarize(
    baseline_answers: Sequence[dict], method_answers: Sequence[dict], *, name: str = "method"
) -> dict[str, Any]:
    """Speed summary of `method_answers` against `baseline_answers`, over common questions.

    Returns `{"overall": stats, "by_category": {category: stats}}` where stats has the keys
    `COLUMNS`. Questions answered by only one side are dropped with a warning.
    """
    base = _by_id(baseline_answers, "baseline")
    method = _by_id(method_answers, name)
    common = [qid for qid in method if qid in base]
    if not common:
        raise UserError(f"{name}: no questions in common with the baseline")
    only_base, only_method = len(base) - len(common), len(method) - len(common)
    if only_base or only_method:
        warnings.warn(
            f"{name}: dropped {only_base} questions only the baseline answered and "
            f"{only_method} only the method answered; reporting over {len(common)} common ones",
            stacklevel=2,
        )
    by_category: dict[str, tuple[list[dict], list[dict]]] = {}
    for qid in common:
        category = method[qid]["category"]
        if base[qid]["category"] != category:
            raise UserError(
                f"{name}: question {qid!r} is {category!r} here but "
                f"{base[qid]['category']!r} in the baseline"
            )
        pair = by_category.setdefault(category, ([], []))
        pair[0].append(base[qid])
        pair[1].append(method[qid])
    return {
        "overall": _stats([base[q] for q in common], [method[q] for q in common]),
        "by_category": {c: _stats(*by_category[c]) for c in sorted(by_category)},
    }


def _gamma(records: Sequence[dict], name: str) -> int | None:
    """The method's draft length from the records' optional `gamma` field, None if absent."""
    gammas = {r.get("gamma") for r in records}
    if len(gammas) > 1:
        raise UserError(f"{name}: answers mix gamma values {sorted(gammas, key=str)}")
    return gammas.pop() if gammas else None


def _markdown(summaries: Mapping[str, dict], baseline: str, plots: Sequence[str],
              quality: str = "") -> str:
    head = ("| method | tokens/s | speedup | tau | same text as baseline | questions |\n"
            "|---|---:|---:|---:|---:|---:|")
    rows = [head]
    for name, s in summaries.items():
        o = s["overall"]
        rows.append(
            f"| {name} | {o['tokens_per_s']:.2f} | {o['speedup']:.3f}x | {o['tau']:.3f} "
            f"| {o['identical']} | {o['num_questions']} |"
        )
    cat_rows = [
        "| method | category | tokens/s | speedup | tau | questions |\n"
        "|---|---|---:|---:|---:|---:|"
    ]
    for name, s in summaries.items():
        for category, c in s["by_category"].items():
            cat_rows.append(
                f"| {name} | {category} | {c['tokens_per_s']:.2f} | {c['speedup']:.3f}x "
                f"| {c['tau']:.3f} | {c['num_questions']} |"
            )
    parts = [
        "# Speculative decoding benchmark",
        f"Baseline: `{baseline}`. Speedup is the mean per-question tokens/s of a method over the "
        "baseline's, on the questions both answered; tau is the mean number of tokens emitted "
        "per target step; same text: answers equal to the baseline's (all of them, for greedy "
        "speculative decoding with the baseline's weights).",
        "## Overall",
        "\n".join(rows),
        "## By category",
        "\n".join(cat_rows),
        *(["## Quality against references", quality] if quality else []),
        *[f"![{Path(p).stem}]({p})" for p in plots],
    ]
    return "\n\n".join(parts) + "\n"


def _write_csv(path: Path, summaries: Mapping[str, dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(("method", "category", *COLUMNS))
        for name, s in summaries.items():
            writer.writerow((name, "overall", *(s["overall"][k] for k in COLUMNS)))
            for category, c in s["by_category"].items():
                writer.writerow((name, category, *(c[k] for k in COLUMNS)))


def report(
    answer_files: Mapping[str, str | os.PathLike[str]],
    baseline: str,
    out_dir: str | os.PathLike[str],
    references: Mapping[Any, str] | None = None,
) -> dict[str, dict]:
    """Write report.md, report.csv and PNG plots to `out_dir`; return `{method: summarize(...)}`.

    With `references` ({question_id: reference translation}), each method's first-turn texts
    also get corpus chrF and BLEU (`overall["chrf"]`, `overall["bleu"]`), to show that speed did
    not cost quality.

    `answer_files` maps method names to model_answer JSONL paths and must include `baseline`
    (reported first, speedup 1). The speedup-vs-gamma plot is drawn when methods' records carry
    at least two distinct `gamma` values.
    """
    if baseline not in answer_files:
        raise UserError(f"baseline {baseline!r} is not among the methods {list(answer_files)}")
    answers = {name: read_answers(path) for name, path in answer_files.items()}
    names = [baseline, *(n for n in answers if n != baseline)]
    summaries = {n: summarize(answers[baseline], answers[n], name=n) for n in names}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    speeds = {n: summaries[n]["overall"]["tokens_per_s"] for n in names}
    plot_tokens_per_s(speeds, out / "tokens_per_s.png")
    plot_accept_lengths(
        {n: [a for r in answers[n] for a in r["choices"][0]["accept_lengths"]] for n in names},
        out / "accept_lengths.png",
    )
    plots = ["tokens_per_s.png", "accept_lengths.png"]
    gammas = {n: _gamma(answers[n], n) for n in names}
    points = [
        (n, g, summaries[n]["overall"]["speedup"]) for n, g in gammas.items()
        if isinstance(g, int)  # not None (no draft) nor "auto"
    ]
    if len({g for _, g, _ in points}) >= 2:
        plot_speedup_vs_gamma(points, out / "speedup_vs_gamma.png")
        plots.append("speedup_vs_gamma.png")

    quality = ""
    if references:
        rows = ["| method | chrF | BLEU | questions |", "|---|---:|---:|---:|"]
        for n in names:
            pairs = [(r["choices"][0]["turns"][0], references[r["question_id"]])
                     for r in answers[n] if r["question_id"] in references]
            if not pairs:
                raise UserError(f"no reference matches a question answered by {n!r}")
            scores = chrf_bleu(*zip(*pairs))
            summaries[n]["overall"].update(scores)
            rows.append(f"| {n} | {scores['chrf']:.2f} | {scores['bleu']:.2f} | {len(pairs)} |")
        quality = "\n".join(rows)
    (out / "report.md").write_text(_markdown(summaries, baseline, plots, quality),
                                   encoding="utf-8")
    _write_csv(out / "report.csv", summaries)
    return summaries


def chrf_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus chrF and BLEU (sacrebleu) of hypotheses against one reference each."""
    try:
        import sacrebleu
    except ImportError as err:
        raise ImportError("chrf_bleu needs sacrebleu: pip install sacrebleu") from err
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    refs = [list(references)]
    return {
        "chrf": sacrebleu.corpus_chrf(list(hypotheses), refs).score,
        "bleu": sacrebleu.corpus_bleu(list(hypotheses), refs).score,
    }
