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


def test_a_corrupt_compilation_cache_entry_is_compiled_again(tmp_path):
    """Truncated executables in the persistent compilation cache: the next process warns in
    one line, compiles afresh, decodes the same tokens and drops the entry; the one after
    writes it whole again."""
    code = textwrap.dedent("""
        import jax, jaxspec
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        from jaxspec.models.params import init_params
        cfg = jaxspec.ModelConfig(arch="llama", vocab_size=64, hidden_size=32, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=8,
                                  intermediate_size=64, max_position=512)
        m = jaxspec.Model(cfg, init_params(cfg, jax.random.key(0)), None, "tiny")
        print(jaxspec.generate(m, [[1, 2, 3]], max_new_tokens=5).token_ids)
    """)
    env = {"JAXSPEC_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    def run():
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=300)
    first = run()
    assert first.returncode == 0, first.stderr[-2000:]
    entries = [f for f in (tmp_path / "xla").rglob("*") if f.is_file() and f.stat().st_size > 64]
    assert entries and all(f"jaxspec-{importlib.metadata.version('jaxspec')}" in str(f)
                           for f in entries)
    for f in entries:
        f.write_bytes(f.read_bytes()[:40])
    second = run()
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout == first.stdout
    assert "was unreadable; compiled it afresh" in second.stderr
    assert not any(f.exists() for f in entries)
    third = run()
    assert third.returncode == 0 and third.stdout == first.stdout
    assert "unreadable" not in third.stderr
    assert all(f.exists() and f.stat().st_size > 64 for f in entries)
