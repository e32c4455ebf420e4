"""The paper's Table 1 for one target: speedup and tau of each method, one row per language pair.

    python -m jaxspec.bench.table1 runs/bench-deen-hidden runs/bench-fren-heldout ... [--out T.md]
    jaxspec table1 DIR [DIR ...] [--out T.md]

Each DIR is a report directory (holding the `report.csv` that `jaxspec bench` writes), a bench
`out_dir` holding exactly one such directory, or a report.csv itself. Its pair comes from the
report's category column (the held-out question files use one category per pair: `deen`,
`fren`, ...), else from the specialised head it ran (`gemma3-270m-<src>en-drafter`). Several
directories of one pair (say, a separate layer-skip run) are merged.

Columns: AR, n-gram, layer skip, the generic EAGLE head, the pair's own specialised head, and
the de->en head on another pair's prompts (cross-language; shown only where a non-de pair ran
it). A cell is "speedup x / tau (gamma)" at the gamma with the best overall speedup (speedups are
against each report's own AR baseline); "—" where the pair did not run that method. The last
row averages speedup and tau over the pairs that have the column. Greedy (-t0) rows only; token
tree and hf rows are left out.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from pathlib import Path
from typing import Sequence

from jaxspec.errors import UserError

PAIRS = ("de", "fr", "ja", "ru", "zh")  # the paper's order; any other pair comes after these
COLUMNS = (
    ("ar", "AR"),
    ("ngram", "n-gram"),
    ("layerskip", "layer skip"),
    ("generic", "generic EAGLE head"),
    ("specialised", "specialised head"),
    ("cross", "cross-language (de→en head)"),
)
CROSS_SOURCE = "de"  # the head whose transfer to other pairs the cross-language column shows
DASH = "—"

# `specbench.Method.name`: kind[-arg][-g<gamma>|-tree<N>d<D>|-dyn<N>d<D>w<W>]-t<temperature>
_NAME = re.compile(r"^(?P<base>.+?)(?:-g(?P<gamma>\d+|auto)"
                   r"|(?P<tree>-tree\d+d\d+|-dyn\d+d\d+w\d+))?-t(?P<temp>\d[\d.e+-]*)$")
_HEAD = re.compile(r"^drafter-(?:.*-)?(?P<src>[a-z]{2})en-drafter$")  # gemma3-270m-deen-drafter
_CATEGORY = re.compile(r"^(?P<src>[a-z]{2})en$")


def find_report(path: str | Path) -> Path:
    """The report.csv of a report directory, of a bench out_dir with one report, or itself."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "report.csv").is_file():
        return path / "report.csv"
    found = sorted(path.glob("*/report.csv")) if path.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise UserError(f"{path}: no report.csv there (nor in a subdirectory); give the "
                        f"`out_dir` of a `jaxspec bench` run, or its report directory")
    raise UserError(f"{path}: several reports ({', '.join(str(f.parent) for f in found)}); "
                    f"give the one to use")


def read_report(path: Path) -> list[dict]:
    """The overall, greedy rows of a report.csv: [{method, base, gamma, speedup, tau}]."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    missing = {"method", "category", "speedup", "tau"} - set(rows[0] if rows else {})
    if missing:
        raise UserError(f"{path}: not a bench report.csv (no {', '.join(sorted(missing))})")
    out = []
    for row in rows:
        m = _NAME.match(row["method"])
        if row["category"] != "overall" or not m or m["tree"] or float(m["temp"]) != 0:
            continue
        out.append({"method": row["method"], "base": m["base"], "gamma": m["gamma"],
                    "speedup": float(row["speedup"]), "tau": float(row["tau"])})
    return out


def detect_pair(path: Path) -> str:
    """The source language of a report: its one `<src>en` category, else its specialised head
    (the non-de one when it also ran the de->en head)."""
    with open(path, newline="", encoding="utf-8") as f:
        categories = {r["category"] for r in csv.DictReader(f)} - {"overall"}
    by_category = {m["src"] for c in categories if (m := _CATEGORY.match(c))}
    if len(by_category) == 1:
        return by_category.pop()
    heads = {m["src"] for r in read_report(path) if (m := _HEAD.match(r["base"]))}
    if len(heads) > 1:
        heads.discard(CROSS_SOURCE)
    if len(heads) == 1:
        return heads.pop()
    raise UserError(f"{path}: cannot tell its language pair (categories {sorted(categories)}, "
                    f"specialised heads {sorted(heads)})")


def column(base: str, pair: str) -> str | None:
    """The Table 1 column of a method (its name without gamma and temperature) run on `pair`."""
    if base == "ar":
        return "ar"
    if base.startswith(("ngram", "layerskip")):
        return base.split("-")[0]
    if base.startswith("drafter-") and "generic" in base:
        return "generic"
    head = _HEAD.match(base)
    if head and head["src"] == pair:
        return "specialised"
    if head and head["src"] == CROSS_SOURCE:
        return "cross"
    return None


def _order(pair: str) -> tuple:
    return (PAIRS.index(pair), "") if pair in PAIRS else (len(PAIRS), pair)


def table1(dirs: Sequence[str | Path]) -> dict:
    """Table 1 as data: {"pairs": [src, ...], "columns": [[key, title], ...],
    "cells": {src: {key: cell or None}}, "average": {key: {speedup, tau, pairs} or None},
    "reports": {src: [report.csv, ...]}}; a cell is {method, gamma, speedup, tau, report}, the
    method's row with the best speedup (gamma None for AR)."""
    if not dirs:
        raise UserError("give at least one report directory")
    reports: dict[str, list[str]] = {}
    cells: dict[str, dict] = {}
    for d in dirs:
        path = find_report(d)
        pair = detect_pair(path)
        reports.setdefault(pair, []).append(str(path))
        best = cells.setdefault(pair, {key: None for key, _ in COLUMNS})
        for row in read_report(path):
            key = column(row["base"], pair)
            if key and (best[key] is None or row["speedup"] > best[key]["speedup"]):
                best[key] = {**{k: row[k] for k in ("method", "gamma", "speedup", "tau")},
                             "report": str(path)}
    pairs = sorted(cells, key=_order)
    columns = [[k, t] for k, t in COLUMNS
               if k != "cross" or any(cells[p]["cross"] for p in pairs)]
    average = {}
    for key, _ in columns:
        have = [cells[p][key] for p in pairs if cells[p][key]]
        average[key] = {"speedup": statistics.fmean(c["speedup"] for c in have),
                        "tau": statistics.fmean(c["tau"] for c in have),
                        "pairs": len(have)} if have else None
    return {"pairs": pairs, "columns": columns,
            "cells": {p: {k: cells[p][k] for k, _ in columns} for p in pairs},
            "average": average, "reports": {p: reports[p] for p in pairs}}


def _cell(c: dict | None, note: str = "") -> str:
    return DASH if c is None else f"{c['speedup']:.2f}x / {c['tau']:.2f}{note}"


def markdown(data: dict) -> str:
    """The table of `table1(...)` as markdown."""
    titles = [t for _, t in data["columns"]]
    lines = ["| pair | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(titles)]
    for p in data["pairs"]:
        cells = [_cell(c, f" (g{c['gamma']})" if c and c["gamma"] else "")
                 for c in (data["cells"][p][k] for k, _ in data["columns"])]
        lines.append(f"| {p}→en | " + " | ".join(cells) + " |")
    n = len(data["pairs"])
    avg = [_cell(a, f" ({a['pairs']} of {n})" if a and a["pairs"] < n else "")
           for a in (data["average"][k] for k, _ in data["columns"])]
    lines.append("| average | " + " | ".join(avg) + " |")
    return "\n".join(lines) + "\n"


def run(dirs: Sequence[str | Path], out: str | Path | None = None) -> str:
    """Print Table 1 of `dirs` as markdown and, given `out`, write it there too."""
    text = markdown(table1(dirs))
    print(text, end="")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text, encoding="utf-8")
    return text


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench.table1",
                                description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", metavar="DIR", help="report directories or bench out_dirs")
    p.add_argument("--out", help="also write the markdown to this file")
    a = p.parse_args(argv)
    try:
        run(a.dirs, a.out)
    except UserError as e:
        raise SystemExit(f"table1: {e}") from None


if __name__ == "__main__":
    main()
