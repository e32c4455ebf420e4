"""`jaxspec demo`, the README's main job, end to end on the embedded Gemma 3 270M."""

from jaxspec import demo
from jaxspec.cli import main


def test_demo_translates_five_languages_identically_to_greedy(capsys, monkeypatch):
    rows = []
    run = demo.run
    monkeypatch.setattr(demo, "run", lambda *a, **k: rows.extend(run(*a, **k)) or rows)
    main(["demo", "max_new_tokens=12"])
    out = capsys.readouterr().out
    assert [r["language"] for r in rows] == list(demo.SENTENCES)
    for r in rows:
        assert f"[{r['language']}]" in out
        assert r["identical"] and r["translation"]
        assert r["tau"] >= 1.0
        assert r["tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0
    assert out.count("identical to greedy: yes") == len(demo.SENTENCES)
    assert "all outputs identical to greedy decoding: yes" in out
