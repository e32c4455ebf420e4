"""The colab notebooks run top to bottom (CPU, `JAXSPEC_CI=1` shrinks them), their results
pass a check cell run after them in the same kernel, and they are committed without outputs."""

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

COLAB = Path(__file__).resolve().parents[2] / "colab"
NOTEBOOKS = sorted(p.name for p in COLAB.glob("*.ipynb"))
CELL_TIMEOUT = {"quickstart.ipynb": 600, "train_drafter.ipynb": 300}  # seconds per cell
# Appended to each notebook: every speculative run equals greedy decoding, and its tau is the
# mean of its accept lengths, which account for every new token.
_TAU_OK = """
import numpy as np

def check(r, greedy):
    assert r.token_ids == greedy.token_ids, "speculative output differs from greedy"
    gains = [a for row in r.accept_lengths for a in row]
    assert sum(gains) == r.num_new_tokens and max(gains) <= GAMMA + 1
    assert abs(r.tau - np.mean(gains)) < 1e-9, (r.tau, np.mean(gains))
"""
CHECKS = {
    "quickstart.ipynb": _TAU_OK + """
check(ngram, ar)
check(skip, ar)
assert max(ngram.tau, skip.tau) > 1
""",
    "train_drafter.ipynb": _TAU_OK + """
check(before, plain)
check(after, plain)
assert after.tau > before.tau, (before.tau, after.tau)  # training helped
""",
}


def test_the_notebooks_are_there():
    assert {"quickstart.ipynb", "train_drafter.ipynb"} <= set(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_clean(name):
    nb = nbformat.read(COLAB / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, \
                f"{name}: strip outputs before committing (jupyter nbconvert --clear-output)"
    badge = f"colab.research.google.com/github/jaxspec/jaxspec/blob/main/colab/{name}"
    assert badge in nb.cells[0].source
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "JAXSPEC_CI" in params[0].source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_runs_top_to_bottom(name, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CI", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws PNGs
    nb = nbformat.read(COLAB / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(CHECKS[name]))
    client = NotebookClient(nb, timeout=CELL_TIMEOUT.get(name, 300), kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})  # cwd: tmp_path
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    elapsed = time.perf_counter() - t0
    print(f"{name}: {elapsed:.0f}s")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no plot was drawn"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "tau" in text
