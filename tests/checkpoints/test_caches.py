"""Every entry under $JAXSPEC_CACHE is keyed by jaxspec's version and its own format, and a
truncated or corrupt one is rebuilt with a one-line warning: converted weights here, profiles
in tests/decoding/test_profile.py."""

import importlib.metadata
import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.checkpoints import converted
from jaxspec.loading import resolve


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    return tmp_path


def _damage_npy(folder):
    victim = sorted(folder.glob("*.npy"))[0]
    victim.write_bytes(victim.read_bytes()[:100])


def _damage_meta(folder):
    (folder / "converted.json").write_text("{\"config\": ")


def _damage_tokenizer(folder):
    for f in (folder / "tokenizer").iterdir():
        f.write_text("not json")


@pytest.mark.parametrize("damage", [_damage_npy, _damage_meta, _damage_tokenizer])
def test_a_damaged_converted_model_is_converted_again(cache, capsys, damage):
    path = resolve("smollm2-135m-instruct")
    first = jaxspec.load("smollm2-135m-instruct")
    folder = converted.entry(path)
    version = importlib.metadata.version("jaxspec")
    assert folder.parent.name == f"jaxspec-{version}-f{converted.FORMAT}"
    damage(folder)
    capsys.readouterr()
    again = jaxspec.load("smollm2-135m-instruct")
    assert "rebuilding it" in capsys.readouterr().err
    assert jax.tree.all(jax.tree.map(np.array_equal, first.params, again.params))
    assert again.tokenizer("Hello there").input_ids == first.tokenizer("Hello there").input_ids
    assert json.loads((folder / "converted.json").read_text())["params"]  # rewritten whole


def _run(code, tmp_path):
    env = {"JAXSPEC_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


def _truncate_between_runs(code, tmp_path, entries_of):
    """Run `code`, truncate the cache entries it wrote, run it again: (first run, second run,
    the entries), after checking both succeeded alike and the entries are keyed by version."""
    first = _run(code, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    entries = entries_of()
    assert entries and all(f"jaxspec-{importlib.metadata.version('jaxspec')}" in str(f)
                           for f in entries)
    for f in entries:
        f.write_bytes(f.read_bytes()[:40])
    second = _run(code, tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout == first.stdout
    return first, second, entries


def test_a_corrupt_compiled_decode_loop_is_compiled_again(tmp_path):
    """A truncated executable under `$JAXSPEC_CACHE/executables`: the next process warns in one
    line, compiles afresh, decodes the same tokens and writes the entry whole again; the one
    after reads it silently."""
    code = """
        import jax, jaxspec
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        from jaxspec.models.params import init_params
        cfg = jaxspec.ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=8,
                                  intermediate_size=64, max_position=512)
        m = jaxspec.Model(cfg, init_params(cfg, jax.random.key(0)), None, "tiny")
        print(jaxspec.generate(m, [[1, 2, 3]], max_new_tokens=5).token_ids)
    """
    first, second, entries = _truncate_between_runs(
        code, tmp_path, lambda: list((tmp_path / "executables").rglob("*.pkl")))
    assert "is unreadable" in second.stderr and "rebuilding it" in second.stderr
    assert all(f.stat().st_size > 40 for f in entries)  # written whole again: read below
    third = _run(code, tmp_path)
    assert third.returncode == 0 and third.stdout == first.stdout
    assert "unreadable" not in third.stderr


def test_a_corrupt_jax_cache_entry_is_compiled_again(tmp_path):
    """Truncated entries of JAX's persistent cache (what functions outside the decode loops, and
    loops over a mesh, compile through): the next process warns in one line, compiles afresh
    and drops the entry; the one after writes it whole again."""
    code = """
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        from jaxspec.decoding import xla_cache
        xla_cache.use()
        x = np.arange(4.0, dtype=np.float32)  # no other function compiled through the cache
        with xla_cache.reading():
            f = jax.jit(lambda x: jnp.tanh(x) * 3 + 1).lower(x).compile()
        print(f(x))
    """
    first, second, entries = _truncate_between_runs(code, tmp_path, lambda: [
        f for f in (tmp_path / "xla").rglob("*") if f.is_file() and f.stat().st_size > 64])
    assert "was unreadable; compiled it afresh" in second.stderr
    assert not any(f.exists() for f in entries)
    third = _run(code, tmp_path)
    assert third.returncode == 0 and third.stdout == first.stdout
    assert "unreadable" not in third.stderr
    assert all(f.exists() and f.stat().st_size > 64 for f in entries)
