"""Decode loops kept on disk (`decoding/executables.py`): an executable XLA:CPU reads back
without all its functions is compiled afresh at its first call, and its key is not read from
disk again. (A second process reading a loop back: tests/decoding/test_runner.py; damaged
entries: tests/checkpoints/test_caches.py.)"""

import jax
import jax.numpy as jnp
import pytest

from jaxspec.decoding import executables


def _incomplete(*args):
    raise jax.errors.JaxRuntimeError("NOT_FOUND: Function broadcast_add_fusion.4 not found "
                                     "(type id: 1)")


def _twice(x):
    return 2 * x


def test_an_executable_missing_functions_is_compiled_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    args = (jnp.arange(3),)
    path = executables.entry(_twice, {}, args, ())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"an entry read back without its functions")
    built = []
    checked = executables.Checked(_incomplete, path,
                                  lambda: built.append(1) or jax.jit(_twice).lower(*args).compile())
    assert checked(*args).tolist() == [0, 2, 4]
    assert checked(*args).tolist() == [0, 2, 4] and built == [1]  # rebuilt once
    assert "rebuilding it" in capsys.readouterr().err
    assert not path.exists() and executables.entry(_twice, {}, args, ()) is None


def test_other_runtime_errors_are_not_taken_for_a_missing_function(tmp_path):
    def failing(*args):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    checked = executables.Checked(failing, tmp_path / "e.pkl", lambda: pytest.fail("rebuilt"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        checked(jnp.arange(3))


def test_functions_that_donate_arguments_are_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    args = (jnp.arange(3),)
    assert executables.entry(_twice, {}, args, ()) is not None
    assert executables.entry(_twice, {}, args, (0,)) is None


def test_a_process_of_several_keeps_no_executables(tmp_path, monkeypatch):
    """An executable is tied to its process's devices: two processes of one job sharing a cache
    read each other's back and failed at the first call ("Expected args ... to have 1 shards")."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    args = (jnp.arange(3),)
    assert executables.entry(_twice, {}, args, ()) is not None
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert executables.entry(_twice, {}, args, ()) is None
