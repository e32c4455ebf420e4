"""Shared fixtures: the two real models, loaded once per test session."""

import pytest

try:
    import torch
except ModuleNotFoundError:  # torch is a test extra; only the parity tests need it
    torch = None
else:
    # One intra-op thread: on a small shared CPU machine, PyTorch's spinning thread pool next to
    # JAX's makes transformers' generate ~10x slower (measured on 2 cores).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _free_executables():
    """Free compiled executables after each test module. Each XLA:CPU executable keeps a few
    memory mappings while alive; a whole run compiles thousands, and past the kernel's limit
    (vm.max_map_count, 65530 here) the next compile crashes the process (seen as a segfault
    in backend_compile_and_load after ~430 tests)."""
    yield
    import gc

    import jax

    from jaxspec.decoding import runner

    runner.DECODER.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_acceptance_history():
    """Each test starts with no gamma="auto" history (`plan.AcceptanceMemory`), so what a test
    measures does not depend on the tests before it."""
    from jaxspec.decoding import runner

    runner.DECODER.acceptance.clear()


@pytest.fixture(scope="session")
def smollm2():
    """jaxspec.load("smollm2-135m-instruct"): Llama family, GGUF Q4_1, float32 params."""
    import jaxspec

    return jaxspec.load("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def gemma3():
    """jaxspec.load("gemma3-270m"): Gemma 3, GGUF Q4_K_M, float32 params."""
    import jaxspec

    return jaxspec.load("gemma3-270m", dtype="float32")


@pytest.fixture
def recording(monkeypatch):
    """recording(name) replaces jaxspec.<name> (and the `decoding.api` function it is, which
    the router calls) by a wrapper and returns the list of its results."""
    import jaxspec
    from jaxspec.decoding import api

    def install(name):
        results, real = [], getattr(jaxspec, name)

        def record(*args, **kw):
            results.append(real(*args, **kw))
            return results[-1]

        monkeypatch.setattr(jaxspec, name, record)
        monkeypatch.setattr(api, name, record)
        return results
    return install
