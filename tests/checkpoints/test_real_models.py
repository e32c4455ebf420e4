"""The two real models against transformers loading the same GGUF file, on five languages:
tokenizer ids, logits of a full pass, logits through the KV cache, and 32-token greedy output."""

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import jaxspec
from jaxspec import loading
from jaxspec.models.cache import init_cache
from jaxspec.models.transformer import forward

NAMES = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
PROMPTS = {
    "de": "Die Hauptstadt von Deutschland ist Berlin. Die größte Stadt in Bayern ist",
    "fr": "La capitale de la France est Paris. Le plus long fleuve de France est",
    "ja": "日本の首都は東京です。日本で一番高い山は",
    "ru": "Столица России — Москва. Самая длинная река в Европе —",
    "zh": "中国的首都是北京。中国人口最多的城市是",
}
NEW_TOKENS = 32
LOGIT_TOL = 1e-2


@pytest.fixture(scope="module", params=list(NAMES))
def pair(request):
    """(jaxspec model, transformers model, transformers tokenizer), both from the same GGUF."""
    model = request.getfixturevalue(request.param)  # session fixtures from conftest.py
    path = loading.REGISTRY[NAMES[request.param]]()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    yield model, ref, tok
    del ref


@pytest.fixture(scope="module")
def reference(pair):
    """Per prompt: transformers' prompt ids, greedy continuation, and the logits of the full
    sequence (prompt + continuation)."""
    _, ref, tok = pair
    out = {}
    for lang, text in PROMPTS.items():
        ids = tok(text).input_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id)
            new = gen[0, len(ids):].tolist()
            logits = ref(gen).logits[0].numpy()
        out[lang] = dict(ids=ids, new=new, logits=logits)
    return out


def _eos(model, tok):
    return set(model.config.eos_token_ids) | {tok.eos_token_id}


def test_config_matches_transformers(pair):
    model, ref, tok = pair
    c, r = model.config, ref.config
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (
        r.vocab_size, r.hidden_size, r.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        r.num_attention_heads, r.num_key_value_heads, r.head_dim)
    assert tok.eos_token_id in c.eos_token_ids
    if c.arch == "gemma3":
        assert c.sliding_window == r.sliding_window
        assert c.layer_types == tuple("sliding" if t == "sliding_attention" else "full"
                                      for t in r.layer_types)


@pytest.mark.parametrize("lang", list(PROMPTS))
def test_tokenizer_ids_match_transformers(pair, lang):
    model, _, tok = pair
    text = PROMPTS[lang]
    ids = model.tokenizer(text).input_ids
    assert ids == tok(text).input_ids
    assert len(ids) > 3
    assert model.tokenizer.decode(ids, skip_special_tokens=True).strip() == text.strip()
    if tok.chat_template:
        chat = [{"role": "user", "content": text}]
        kw = dict(add_generation_prompt=True, tokenize=True, return_dict=False)
        ours = model.tokenizer.apply_chat_template(chat, **kw)
        assert ours == tok.apply_chat_template(chat, **kw)


def test_score_matches_transformers(pair, reference):
    """One padded batch through `jaxspec.score` (right padding cannot affect a causal model)."""
    model, _, _ = pair
    seqs = [r["ids"] + r["new"] for r in reference.values()]
    batch = np.full((len(seqs), max(map(len, seqs))), model.config.pad_token_id, np.int32)
    for b, s in enumerate(seqs):
        batch[b, :len(s)] = s
    logits = jaxspec.score(model, batch)
    for b, (lang, r) in enumerate(reference.items()):
        got = logits[b, :len(seqs[b])]
        diff = float(np.max(np.abs(got - r["logits"])))
        print(f"{model.name} {lang} score max|diff| {diff:.2e}")
        assert diff < LOGIT_TOL, lang
        assert np.abs(r["logits"]).max() > 10  # real logits, not a degenerate model
        np.testing.assert_array_equal(got.argmax(-1), r["logits"].argmax(-1))


def test_greedy_generate_matches_transformers(pair, reference):
    model, _, tok = pair
    result = jaxspec.generate(model, [r["ids"] for r in reference.values()],
                              max_new_tokens=NEW_TOKENS, temperature=0.0)
    for lang, got in zip(reference, result.token_ids):
        want = reference[lang]["new"]
        assert len(want) == NEW_TOKENS or want[-1] in _eos(model, tok)
        assert got == want, f"{lang}: {tok.decode(got)!r} != {tok.decode(want)!r}"


def greedy_with_cache(model, prompts, steps):
    """Batched greedy decoding on the bare forward pass: rows prefill together (padding slots sit
    past the cache, so they are not written) and then decode one token per call, each row at its
    own position. Returns new tokens [B, steps] and the logits that chose them [B, steps, V]."""
    config = model.config
    B, lengths = len(prompts), np.array([len(p) for p in prompts])
    L, T = lengths.max(), lengths.max() + steps
    tokens = np.full((B, L), config.pad_token_id, np.int32)
    positions = np.full((B, L), T, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)], positions[b, :len(p)] = p, np.arange(len(p))
    fwd = jax.jit(forward, static_argnames="config")
    logits, cache = fwd(model.params, config, tokens, positions, init_cache(config, B, T))
    step_logits = np.asarray(logits)[np.arange(B), lengths - 1]
    new, chosen_by = [], []
    for s in range(steps):
        nxt = step_logits.argmax(-1).astype(np.int32)
        new.append(nxt)
        chosen_by.append(step_logits)
        if s + 1 < steps:
            logits, cache = fwd(model.params, config, nxt[:, None],
                                (lengths + s)[:, None].astype(np.int32), cache)
            step_logits = np.asarray(logits[:, 0])
    return np.stack(new, 1), np.stack(chosen_by, 1)


def test_cached_decoding_matches_transformers(pair, reference):
    """Every decode step's logits through the KV cache, against transformers' full pass."""
    model, _, _ = pair
    new, logits = greedy_with_cache(model, [r["ids"] for r in reference.values()], NEW_TOKENS)
    for b, (lang, r) in enumerate(reference.items()):
        n, p = len(r["new"]), len(r["ids"])
        assert new[b, :n].tolist() == r["new"], lang
        diff = float(np.max(np.abs(logits[b, :n] - r["logits"][p - 1:p - 1 + n])))
        print(f"{model.name} {lang} cached decode max|diff| {diff:.2e}")
        assert diff < LOGIT_TOL, lang
