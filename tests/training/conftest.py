"""Fixtures for the training tests: `helper` loads a helper script as a module; `procs` runs
one as a subprocess (with N CPU devices), and kills it once something appears."""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def helper():
    """`helper("_worker")` -> the module tests/training/_worker.py."""
    def load(name):
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


def start(script: str, *args, devices: int = 1) -> subprocess.Popen:
    """Start tests/training/<script>.py with JAX on `devices` CPU devices."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen([sys.executable, str(HERE / f"{script}.py"), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    """Wait for `proc`; its output, or a failure showing it."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def kill_when(proc: subprocess.Popen, ready, timeout: float = 240) -> None:
    """SIGKILL `proc` as soon as `ready()` is true; fails if it exits first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"worker exited ({proc.returncode}) before it could be killed:\n"
                        f"{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, "timed out waiting to kill the worker"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def procs():
    """start, finish, kill_when, free_port."""
    return types.SimpleNamespace(start=start, finish=finish, kill_when=kill_when,
                                 free_port=free_port)
