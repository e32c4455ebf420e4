"""`jaxspec profile` on a tiny model: the cost curve's shape, the drafter's cost, the cache."""

import json

import jax
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.decoding import profile as prof
from jaxspec.checkpoints import store
from jaxspec.models.params import init_params

CFG = jaxspec.ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=512)


@pytest.fixture
def model():
    return jaxspec.Model(CFG, init_params(CFG, jax.random.key(0)), None, "tiny")


def test_profile_measures_every_size_and_the_drafter(model, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    r = prof.profile(model, "tiny", jaxspec.layer_skip_drafter(model, [1]), "layerskip:1")
    assert list(r["relative_cost"]) == [str(s) for s in prof.SIZES]
    assert r["relative_cost"]["1"] == 1.0
    assert all(t > 0 for t in r["target_ms"].values())
    assert r["drafter_ms_per_token"] > 0 and r["c"] == pytest.approx(
        r["drafter_ms_per_token"] / r["target_ms"]["1"], rel=0.05)
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    assert r["bytes_per_step"] == weights + 2 * 2 * 256 * 2 * 8 * 4
    assert r["bandwidth_gbs"] > 0 and r["roofline_fraction"] > 0
    assert "c(S)/c(1)" in prof.format_profile(r)


def test_profile_is_cached_per_model_dtype_and_drafter(model, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    first = prof.profile(model, "tiny")

    def measure(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(prof, "target_ms", measure)
    assert prof.profile(model, "tiny") == first
    with pytest.raises(AssertionError, match="measured again"):
        prof.profile(model, "tiny", refresh=True)
    with pytest.raises(AssertionError, match="measured again"):
        prof.profile(model, "tiny", jaxspec.ngram_drafter(2), "ngram:2")


def test_cli_profile_prints_json(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prof, "bandwidth_gbs", lambda: 10.0)  # measured in the first test
    store.save(tmp_path / "m", model.params, model.config)
    cli.main(["profile", "--model", str(tmp_path / "m"), "--drafter", "ngram:2", "--json",
              "--dtype", "bfloat16"])
    r = json.loads(capsys.readouterr().out)
    assert r["dtype"] == "bfloat16" and r["drafter"] == "ngram:2" and r["c"] >= 0


def test_step_costs_are_measured_in_the_loop_once(model, tmp_path, monkeypatch):
    """A step drafting gamma tokens, timed in the decode loop against a plain step, and cached
    with the drafter's profile: asking for a longer draft measures only the new lengths."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(prof, "bandwidth_gbs", lambda: 10.0)
    drafter = jaxspec.layer_skip_drafter(model, [1])
    costs = prof.step_costs(model, "tiny", drafter, "layerskip:1", 1)
    assert len(costs) == 2 and costs[0] == 1.0 and costs[1] > 0
    measured = []
    real = prof.loop_ms
    monkeypatch.setattr(prof, "loop_ms", lambda m, d, gs: measured.append(gs) or real(m, d, gs))
    longer = prof.step_costs(model, "tiny", drafter, "layerskip:1", 2)
    assert longer[:2] == costs and longer[2] >= longer[1] and measured == [[2]]
    assert prof.step_costs(model, "tiny", drafter, "layerskip:1", 2) == longer
    assert measured == [[2]]
    r = prof.profile(model, "tiny", drafter, "layerskip:1")
    assert sorted(r["loop_ms"]) == ["0", "1", "2"]
    assert "decode-loop step by gamma: 0: " in prof.format_profile(r)
