"""Bit-exact verification: a row's logits must not depend on how many rows run with it, or a
verify pass over several positions could pick another token than a one-position step at a
near-tie (seen in bfloat16 before this held: 1-2 answers in 40 differed from greedy)."""

import os
import subprocess
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import cpu_flags
from jaxspec.models import layers as L
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward

SENTENCE = "Translate German to English: Der alte Fischer verkauft seinen Fang am Hafen.\nEnglish:"


@pytest.mark.parametrize("F", [2048, 4096])
def test_bfloat16_linear_rows_do_not_depend_on_row_count(F):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 9, 640)), jnp.float32)
    w_FxD = jnp.asarray(rng.standard_normal((F, 640)) * 0.05, jnp.bfloat16)
    f = jax.jit(L.linear)
    full = np.asarray(f(x, w_FxD))
    for rows in range(1, 9):
        np.testing.assert_array_equal(np.asarray(f(x[:, :rows], w_FxD))[0], full[0, :rows],
                                      err_msg=f"{rows} rows")


def _bf16(model):
    return replace(model, params=jax.tree.map(lambda p: p.astype(jnp.bfloat16), model.params))


@pytest.mark.parametrize("name", ["gemma3", "smollm2"])
def test_verify_pass_equals_one_position_steps(name, request):
    """Real model, bfloat16 weights: logits and last-layer features of 6 positions scored in
    one forward equal, bit for bit, those of 6 one-position steps (the identity speculative
    decoding rests on), and so do the caches they leave."""
    model = _bf16(request.getfixturevalue(name))
    ids = np.asarray(model.tokenizer(SENTENCE)["input_ids"], np.int32)[None]
    T, S = ids.shape[1], 6
    P = T - S
    f = jax.jit(lambda p, t, pos, c: forward(p, model.config, t, pos, c, features=True))
    cache = init_cache(model.config, 1, 64, jnp.bfloat16)
    _, cache, _ = f(model.params, jnp.asarray(ids[:, :P]), jnp.arange(P)[None], cache)
    many_logits, many_cache, many_x = f(model.params, jnp.asarray(ids[:, P:]),
                                        jnp.arange(P, T)[None], cache)
    for i in range(P, T):
        logits, cache, x = f(model.params, jnp.asarray(ids[:, i:i + 1]), jnp.array([[i]]), cache)
        np.testing.assert_array_equal(np.asarray(logits[0, 0]), np.asarray(many_logits[0, i - P]))
        np.testing.assert_array_equal(np.asarray(x[0, 0]), np.asarray(many_x[0, i - P]))
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(many_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _flags_after_import(env):
    code = ("import warnings, jax; warnings.simplefilter('error')\n"
            "import jaxspec, os; print(os.environ.get('XLA_FLAGS', ''))")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSPEC_CPU_FMA")} | env
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


@pytest.mark.skipif(not cpu_flags.applies(), reason="x86 CPUs only")
def test_import_caps_xla_cpu_isa_unless_told_otherwise():
    assert _flags_after_import({}).stdout.split() == [cpu_flags.FLAG]
    kept = "--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=2"
    assert _flags_after_import({"XLA_FLAGS": kept}).stdout.split() == kept.split()
    assert _flags_after_import({"JAXSPEC_CPU_FMA": "1"}).stdout.split() == []
    assert "xla_cpu_max_isa" in os.environ.get("XLA_FLAGS", "")  # this test process too


@pytest.mark.skipif(not cpu_flags.applies(), reason="x86 CPUs only")
def test_import_after_jax_started_warns():
    code = ("import jax, warnings; jax.devices()\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); import jaxspec\n"
            "print(len(w), 'FMA' in str(w[0].message) if w else '')")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSPEC_CPU_FMA")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "True"], out.stderr


@pytest.fixture(scope="module")
def gemma3_bf16():
    return jaxspec.load("gemma3-270m", dtype="bfloat16")  # as `jaxspec demo` and bench load it


# One-shot prompts on sentences the target wrote (data/heldout/fren_question.jsonl); with a
# float32 cache the first one's gamma-3 verify picked another token at its 4th step.
PROMPTS = [("Translate French to English:Je bois un café tous les matins.\nEnglish: I drink a "
            "coffee every morning.\nTranslate French to English:" + s + "\nEnglish:")
           for s in ("<b>Comment devenir comment cela se passe ?",
                     "Les paysages télégrossiers dans lesquels dureront jusqu'en 2024 les "
                     "coutumes impérialistes.",
                     "Nous déjeunons-t-il presque nuitée, mais pendant cette nuitée,")]


@pytest.mark.parametrize("gamma", [1, 3, 5, "auto"])
def test_bfloat16_speculative_decoding_equals_greedy(gemma3_bf16, gamma):
    """Through the decoder (prefill, bfloat16 cache, verify of gamma + 1 positions, and with
    gamma "auto" steps of 0 and 3 drafts inside one lax.switch): greedy tokens, always."""
    kw = dict(costs=(1.0, 1.5, 1.6, 1.7, 1.8)) if gamma == "auto" else {}
    for prompt in PROMPTS:  # batch 1, as benchmarks run: a batch has more rows per product
        ref = jaxspec.generate(gemma3_bf16, [prompt], max_new_tokens=64, stop="\n")
        res = jaxspec.speculative_generate(gemma3_bf16, jaxspec.ngram_drafter(3), [prompt],
                                           gamma=gamma, max_new_tokens=64, stop="\n", **kw)
        assert res.token_ids == ref.token_ids


@pytest.fixture(scope="module")
def smollm2_bf16():
    return jaxspec.load("smollm2-135m-instruct", dtype="bfloat16")


# A chat prompt whose first verify pass with a draft scored the last token differently from a
# one-position step before attention scored each query in a product of its own (layer 5 of
# SmolLM2, 3 query heads a group: 3 rows against 6); greedy and n-gram answers then differed.
SMOLLM2_PROMPT = ("Translate German to English:Einen Tag nach der Schießerei in der Universität, "
                  "die Studenten und Dozenten dazu zwang, sich hinter verschlossenen Türen zu "
                  "verstecken, versuchen die Behörden immer noch, sich ein Bild davon zu "
                  "verschaffen, was Lamb motivierte.")


@pytest.mark.parametrize("name", ["gemma3", "smollm2"])
def test_decoder_verify_root_logits_do_not_depend_on_draft_length(name, request):
    """The decoder's own prefill and verify (its cache, tree view and slots), batch 1: the last
    token's logits are the same bits whether 0 or up to 5 drafts ride along. (Measured: with
    a float32 cache, 3 or more drafts changed them; since each query is scored in its own
    product, Gemma's 6, 7 and 8 drafts give the same bits too, not run here to save time.)"""
    from jaxspec.decoding import speculative
    from jaxspec.decoding.runner import encode_prompts
    from jaxspec.decoding.trees import chain

    m, T = request.getfixturevalue(f"{name}_bf16"), 256
    ids = (m.tokenizer(PROMPTS[0])["input_ids"] if name == "gemma3" else
           encode_prompts(m, [SMOLLM2_PROMPT], chat=True)[0])
    tokens = np.zeros((1, T), np.int32)
    tokens[0, :len(ids)] = ids
    # The params are arguments, not constants: closed over, XLA folds 270M of them at compile.
    state = jax.jit(lambda p, t: speculative.prefill(
        p, m.config, None, t, jnp.array([len(ids)]), jnp.array([64]),
        jax.random.key(0)))(m.params, jnp.asarray(tokens))
    drafts = [2088, 776, 611, 3291, 672] if name == "gemma3" else [28, 5437, 611, 3291, 672]
    verify = jax.jit(lambda p, s, d: speculative.verify(p, m.config, s, d, chain(d.shape[1]))[0])
    roots = [np.asarray(verify(m.params, state, jnp.asarray([drafts[:g]], jnp.int32)))[0, 0]
             for g in range(6)]
    for g in range(1, 6):
        np.testing.assert_array_equal(roots[g], roots[0], err_msg=f"{g} drafts")
