"""No development or benchmark sentence in the training data: the distilled text the shipped
drafters were trained on (`data/distilled/*.tar.xz`) and the recipes' data sources."""

import functools
import json
import re
import tarfile
from pathlib import Path

import pytest

from jaxspec.config import load_yaml
from jaxspec.questions import read_questions

ROOT = Path(__file__).parents[2]
SPECBENCH = ROOT.parent / "shared" / "data" / "specbench"
WINDOW = 40  # characters: a longer run shared with a dev sentence (or all of a shorter one) leaks


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@functools.cache
def _dev_windows() -> tuple[dict[str, str], tuple[str, ...]]:
    """Every WINDOW-character run of every benchmark sentence (the text after the
    "Translate X to English:" instruction) -> the sentence's id; and the sentences shorter than
    WINDOW (keys too, whole)."""
    windows = {}
    files = sorted(SPECBENCH.glob("*.jsonl"))
    assert len(files) == 5, files
    for path in files:
        for q in read_questions(path):
            sentence = _squash(q["turns"][0].split(":", 1)[1])
            for i in range(max(len(sentence) - WINDOW, 0) + 1):
                windows[sentence[i:i + WINDOW]] = f"{path.name}:{q['question_id']}"
    return windows, tuple(w for w in windows if len(w) < WINDOW)


def _leaks(text: str) -> set[str]:
    windows, short = _dev_windows()
    text = _squash(text)
    found = {windows[text[i:i + WINDOW]] for i in range(len(text) - WINDOW + 1)
             if text[i:i + WINDOW] in windows}
    return found | {windows[w] for w in short if w in text}


def test_the_leak_check_finds_a_planted_sentence():
    dev = read_questions(SPECBENCH / "jaen_dev.jsonl")[7]
    planted = "Translate Japanese to English:" + dev["turns"][0].split(":", 1)[1][-45:] + "\n"
    assert _leaks("English: a preamble.\n" + planted) == {
        f"jaen_dev.jsonl:{dev['question_id']}"}
    assert not _leaks("Translate German to English:Ich trinke jeden Morgen einen Kaffee.")


@pytest.mark.parametrize("archive", sorted((ROOT / "data" / "distilled").glob("*.tar.xz")),
                         ids=lambda p: p.name.split(".")[0])
def test_no_dev_sentence_in_the_distilled_text(archive):
    found, records = {}, 0
    with tarfile.open(archive) as tar:
        for member in tar:
            if not member.name.endswith(".jsonl"):
                continue
            for line in tar.extractfile(member).read().decode().split("\n"):
                if not line:
                    continue
                r = json.loads(line)
                records += 1
                for leak in _leaks(r["prompt"] + r["response"]):
                    found[leak] = r["id"]
    assert records > 1000
    assert not found, f"dev sentences in {archive.name} (sentence: record id): {found}"


def test_no_recipe_trains_on_a_benchmark_file_or_a_test_split():
    for path in sorted(ROOT.glob("configs/*.yaml")):
        for name, source in load_yaml(path).get("data", {}).items():
            if name == "eval":
                continue
            assert source.get("split") != "test", (path.name, name)
            assert "specbench" not in json.dumps(source), (path.name, name)
