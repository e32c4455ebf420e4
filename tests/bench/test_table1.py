"""Table 1 across language pairs, from synthetic report.csv files."""

import csv
import json

import pytest

from jaxspec.bench import table1
from jaxspec.errors import UserError

HEADER = ("method", "category", "tokens_per_s", "baseline_tokens_per_s", "speedup", "tau",
          "num_questions")
GENERIC = "drafter-drafter-generic"


def head(src):
    return f"drafter-gemma3-270m-{src}en-drafter"


def write_report(directory, category, rows):
    """A report.csv like `report._write_csv`: rows {method: (speedup, tau)}, each written as an
    overall row and a `category` row."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "report.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for method, (speedup, tau) in rows.items():
            for cat in ("overall", category):
                w.writerow((method, cat, 10 * speedup, 10.0, speedup, tau, 40))
    return directory


@pytest.fixture
def dirs(tmp_path):
    """de (report dir), fr (a bench out_dir holding report/), ja (with a category that names no
    pair, so its pair comes from its specialised head): several gammas, methods missing."""
    de = write_report(tmp_path / "bench-deen" / "report", "deen", {
        "ar-t0": (1.0, 1.0),
        "ngram-3-g1-t0": (1.20, 1.10), "ngram-3-g3-t0": (1.27, 1.17),
        "ngram-3-gauto-t0": (1.05, 1.16),
        f"{GENERIC}-g1-t0": (0.99, 1.16), f"{GENERIC}-gauto-t0": (1.02, 1.18),
        f"{head('de')}-g1-t0": (1.02, 1.23), f"{head('de')}-g2-t0": (1.08, 1.26),
        "layerskip-16-g1-t0": (0.85, 1.70),
        "ngram-3-g2-t0.7": (9.0, 9.0),  # sampled: not in the greedy table
        f"{head('de')}-tree7d3-t0": (9.0, 9.0),  # a token tree: not a gamma row
    })
    fr = write_report(tmp_path / "bench-fren" / "report", "fren", {
        "ar-t0": (1.0, 1.0),
        "ngram-3-g1-t0": (1.10, 1.05), "ngram-3-g2-t0": (1.05, 1.09),
        f"{head('fr')}-g1-t0": (1.04, 1.30), f"{head('fr')}-gauto-t0": (1.12, 1.35),
        f"{head('de')}-g1-t0": (0.95, 1.12), f"{head('de')}-g2-t0": (0.97, 1.15),
    })
    ja = write_report(tmp_path / "bench-jaen", "translation", {
        "ar-t0": (1.0, 1.0),
        "ngram-3-g1-t0": (1.00, 1.01),
        f"{GENERIC}-g2-t0": (0.90, 1.10),
        f"{head('ja')}-g1-t0": (1.01, 1.20),
    })
    return {"de": de, "fr": tmp_path / "bench-fren", "ja": ja}


def test_pair_detection(dirs):
    assert table1.detect_pair(table1.find_report(dirs["de"])) == "de"
    assert table1.detect_pair(table1.find_report(dirs["fr"])) == "fr"  # category, not heads
    assert table1.detect_pair(table1.find_report(dirs["ja"])) == "ja"  # from its own head


def test_best_gamma_per_method(dirs):
    data = table1.table1([dirs["ja"], dirs["fr"], dirs["de"]])
    assert data["pairs"] == ["de", "fr", "ja"]  # the paper's order, whatever the argument order
    de, fr = data["cells"]["de"], data["cells"]["fr"]
    assert (de["ngram"]["gamma"], de["ngram"]["speedup"], de["ngram"]["tau"]) == ("3", 1.27, 1.17)
    assert (de["generic"]["gamma"], de["generic"]["speedup"]) == ("auto", 1.02)
    assert (de["specialised"]["method"], de["specialised"]["speedup"]) == (f"{head('de')}-g2-t0",
                                                                          1.08)
    assert de["layerskip"]["speedup"] == 0.85
    assert de["ar"] == {"method": "ar-t0", "gamma": None, "speedup": 1.0, "tau": 1.0,
                        "report": str(dirs["de"] / "report.csv")}
    assert (fr["ngram"]["gamma"], fr["specialised"]["gamma"]) == ("1", "auto")
    json.dumps(data)  # plain data


def test_cross_language_only_on_non_de_pairs(dirs):
    data = table1.table1([dirs["de"], dirs["fr"], dirs["ja"]])
    assert [k for k, _ in data["columns"]][-1] == "cross"
    cross = {p: data["cells"][p]["cross"] for p in data["pairs"]}
    assert cross["de"] is None  # the de head on de is the specialised head
    assert (cross["fr"]["gamma"], cross["fr"]["speedup"], cross["fr"]["tau"]) == ("2", 0.97, 1.15)
    assert cross["ja"] is None
    # no non-de pair ran the de head: no cross-language column at all
    only = table1.table1([dirs["de"], dirs["ja"]])
    assert "cross" not in [k for k, _ in only["columns"]]
    assert "cross-language" not in table1.markdown(only)


def test_average_row(dirs):
    data = table1.table1([dirs["de"], dirs["fr"], dirs["ja"]])
    avg = data["average"]
    assert avg["ngram"]["speedup"] == pytest.approx((1.27 + 1.10 + 1.00) / 3)
    assert avg["ngram"]["tau"] == pytest.approx((1.17 + 1.05 + 1.01) / 3)
    assert avg["ngram"]["pairs"] == 3
    assert avg["generic"]["speedup"] == pytest.approx((1.02 + 0.90) / 2)  # fr did not run it
    assert avg["generic"]["pairs"] == 2
    assert avg["layerskip"] == {"speedup": 0.85, "tau": 1.70, "pairs": 1}
    assert avg["cross"] == {"speedup": 0.97, "tau": 1.15, "pairs": 1}


def test_markdown(dirs):
    text = table1.markdown(table1.table1([dirs["de"], dirs["fr"], dirs["ja"]]))
    lines = text.splitlines()
    assert lines[0] == ("| pair | AR | n-gram | layer skip | generic EAGLE head | "
                        "specialised head | cross-language (de→en head) |")
    assert lines[2] == ("| de→en | 1.00x / 1.00 | 1.27x / 1.17 (g3) | 0.85x / 1.70 (g1) | "
                        "1.02x / 1.18 (gauto) | 1.08x / 1.26 (g2) | — |")
    assert lines[3] == ("| fr→en | 1.00x / 1.00 | 1.10x / 1.05 (g1) | — | — | "
                        "1.12x / 1.35 (gauto) | 0.97x / 1.15 (g2) |")
    assert lines[4].startswith("| ja→en | 1.00x / 1.00 | 1.00x / 1.01 (g1) | — | "
                               "0.90x / 1.10 (g2)")
    assert lines[5].startswith("| average | 1.00x / 1.00 | 1.12x / 1.08 | 0.85x / 1.70 (1 of 3) |")
    assert len(lines) == 6


def test_one_pair_in_two_directories_is_merged(dirs, tmp_path):
    skip = write_report(tmp_path / "bench-deen-skip", "deen",
                        {"ar-t0": (1.0, 1.0), "layerskip-13-16-g1-t0": (0.90, 1.50)})
    data = table1.table1([dirs["de"], skip])
    assert data["pairs"] == ["de"]
    assert data["cells"]["de"]["layerskip"]["method"] == "layerskip-13-16-g1-t0"
    assert len(data["reports"]["de"]) == 2


def test_directory_without_report_is_a_user_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no report.csv"):
        table1.table1([tmp_path / "empty"])
    with pytest.raises(UserError, match="no report.csv"):
        table1.table1([tmp_path / "missing"])


def test_cli_writes_markdown(dirs, tmp_path, capsys):
    from jaxspec import cli

    out = tmp_path / "t" / "table1.md"
    cli.main(["table1", str(dirs["de"]), str(dirs["fr"]), "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed == out.read_text(encoding="utf-8")
    assert "| fr→en |" in printed
    with pytest.raises(SystemExit, match="jaxspec table1: .*no report.csv"):
        cli.main(["table1", str(tmp_path / "nowhere")])
    table1.main([str(dirs["de"])])
    assert "| de→en |" in capsys.readouterr().out
