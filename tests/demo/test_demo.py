"""`jaxspec demo`, the README's main job, end to end on the embedded Gemma 3 270M."""

import numpy as np
import pytest

import jaxspec
from jaxspec import demo
from jaxspec.cli import main


def test_demo_translates_five_languages_identically_to_greedy(capsys, monkeypatch, recording):
    rows = []
    run = demo.run
    monkeypatch.setattr(demo, "run", lambda *a, **k: rows.extend(run(*a, **k)) or rows)
    greedy = recording("generate")
    spec = recording("speculative_generate")
    from jaxspec.decoding import runner

    before = runner.DECODER.compiles
    main(["demo", "max_new_tokens=12", "repeats=2"])
    # One plain and one speculative executable serve every call, the five heads' included
    # (their params and step costs are data), and gamma auto's step-cost profile runs on them.
    assert runner.DECODER.compiles - before == 2
    out = capsys.readouterr().out
    assert [r["language"] for r in rows] == list(demo.SENTENCES)
    assert len(greedy) == len(spec) == 2 * len(rows)  # each sentence twice each way
    assert [g.token_ids for g in greedy[::2]] == [g.token_ids for g in greedy[1::2]]
    fastest = lambda runs: [min(pair, key=lambda r: r.wall_time_s)  # noqa: E731
                            for pair in zip(runs[::2], runs[1::2])]
    for r, g, sp in zip(rows, fastest(greedy), fastest(spec)):
        assert f"[{r['language']}]" in out
        assert r["identical"] and r["translation"]
        assert sp.token_ids == g.token_ids and len(g.token_ids[0]) > 0
        # tau is new tokens per verification step of this row's speculative run.
        [gains] = sp.accept_lengths
        [drafted] = sp.draft_lengths  # gamma "auto", at most 4
        assert sum(gains) == len(sp.token_ids[0])
        assert all(1 <= a <= d + 1 <= 5 for a, d in zip(gains, drafted))
        assert r["mean_gamma"] == pytest.approx(np.mean(drafted))
        assert r["tau"] == pytest.approx(np.mean(gains))
        assert r["tokens_per_s"] == sp.tokens_per_s > 0
        assert r["baseline_tokens_per_s"] == g.tokens_per_s > 0
    assert any(r["tau"] > 1 for r in rows)  # lookup drafts are accepted somewhere
    assert out.count("identical to greedy: yes") == len(demo.SENTENCES)
    assert "all outputs identical to greedy decoding: yes" in out
