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


def test_step_costs_are_measured_in_the_loop_once(model, tmp_path, monkeypatch, capsys):
    """Step costs of draft lengths 0..G, timed in the decode loop against a plain step and
    cached per drafter and G: a second call reads them; a damaged cache file is measured again
    with a one-line warning."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    drafter = jaxspec.layer_skip_drafter(model, [1])
    measured = []
    real = prof.loop_ms
    monkeypatch.setattr(prof, "loop_ms", lambda m, d, G: measured.append(G) or real(m, d, G))
    costs = prof.step_costs(model, "tiny", drafter, "layerskip:1", 2)
    assert len(costs) == 3 and costs[0] == 1.0 and costs[2] >= costs[1] > 0
    assert prof.step_costs(model, "tiny", drafter, "layerskip:1", 2) == costs
    assert measured == [2]
    [path] = (tmp_path / "profile").glob("*/loop-*.json")
    path.write_text(path.read_text()[:20])  # a truncated write
    assert len(prof.step_costs(model, "tiny", drafter, "layerskip:1", 2)) == 3
    assert measured == [2, 2] and "rebuilding it" in capsys.readouterr().err
    r = {**prof.profile(model, "tiny", drafter, "layerskip:1"), "step_costs": costs}
    assert "decode-loop step cost by gamma, in plain steps: 0: 1.000" in prof.format_profile(r)


def test_a_noisy_round_cannot_make_longer_drafts_free():
    """Medians falling with the draft length (noise) give the line the drafter's own
    per-draft cost as its slope, through their mean; a rising line is kept as fitted."""
    flat = prof.step_line([1, 2, 4], [1.23, 1.22, 1.20], 0.03, 4)
    assert flat == pytest.approx([1.1767, 1.2067, 1.2367, 1.2667], abs=1e-4)
    assert prof.step_line([1, 2, 4], [1.1, 1.2, 1.4], 0.03, 3) == pytest.approx([1.1, 1.2, 1.3])
    assert prof.step_line([1], [1.1], 0.03, 1) == pytest.approx([1.1])


def test_a_damaged_profile_is_measured_again(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(prof, "bandwidth_gbs", lambda: 10.0)
    first = prof.profile(model, "tiny")
    [path] = (tmp_path / "profile").glob("*/profile-*.json")
    path.write_text('{"model": "tiny"}')  # valid JSON without the measurements
    again = prof.profile(model, "tiny")
    assert again.keys() == first.keys() and "rebuilding it" in capsys.readouterr().err


def test_loop_steps_below_the_timers_noise_still_cost_something(monkeypatch):
    """A tiny model's step can time no slower over 6 tokens than over 1 (noise): the sample is
    taken again over longer outputs, then from the whole call, never as zero (a zero plain step
    divided the step costs by zero)."""
    import types

    from jaxspec.decoding import runner

    calls = []

    def decoder(target, drafter, prompt, **kw):
        calls.append(kw["max_new_tokens"])
        return types.SimpleNamespace(accept_lengths=[[1] * kw["max_new_tokens"]],
                                     wall_time_s=0.002)  # as fast for 1 token as for 24

    monkeypatch.setattr(runner, "DECODER", decoder)
    monkeypatch.setattr(prof, "drafter_ms", lambda drafter, config, gamma=1: 0.0)
    ms = prof.loop_ms(types.SimpleNamespace(config=None), None, 2, tokens=6, rounds=1)
    assert len(ms) == 3 and all(t > 0 for t in ms)
    assert ms[0] == pytest.approx(2.0 / 24)  # the whole 24-token call, per step
    assert {6, 12, 24} <= set(calls)
