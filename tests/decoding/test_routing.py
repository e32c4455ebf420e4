"""Per-language drafter routing: language detection, one drafter per detected language with a
fallback for the rest, greedy identity in the prompts' order, and errors at registration."""

import numpy as np
import pytest

import jaxspec
from jaxspec import loading
from jaxspec.checkpoints import heads, store
from jaxspec.decoding.routing import Router, detect_language
from jaxspec.errors import UserError

# Written for these tests (not the benchmark's or the demo's sentences).
SENTENCES = {
    "de": ["Kannst du mir bitte das Salz geben?",
           "Der Zug hatte heute zwanzig Minuten Verspätung.",
           "Meine Schwester wohnt seit drei Jahren in Hamburg."],
    "fr": ["Peux-tu me passer le sel, s'il te plaît ?",
           "Le train avait vingt minutes de retard.",
           "Ma sœur habite à Marseille depuis trois ans."],
    "ja": ["塩を取ってくれませんか。", "今日は電車が二十分遅れました。",
           "姉は三年前から大阪に住んでいます。"],
    "ru": ["Передай мне, пожалуйста, соль.",
           "Сегодня поезд опоздал на двадцать минут.",
           "Моя сестра уже три года живёт в Казани."],
    "zh": ["请把盐递给我。", "今天火车晚点了二十分钟。", "我姐姐在上海住了三年了。"],
}
SPANISH = "¿Me pasas la sal, por favor?"
ITALIAN = "Il treno è partito con venti minuti di ritardo."


def test_detects_five_languages():
    texts = [s for ss in SENTENCES.values() for s in ss]
    want = [code for code, ss in SENTENCES.items() for _ in ss]
    assert detect_language(texts) == want
    assert detect_language(SPANISH) == ["es"]
    assert detect_language(["12345", ""]) == ["und", "und"]


@pytest.fixture(scope="module")
def drafters(near_model):
    # A distinct drafter per language, so each row's drafter shows in the result.
    return {"de": "ngram:1", "fr": "ngram:2", "ja": "layerskip:1", "ru": near_model,
            "zh": "ngram:4"}


def test_routes_each_language_and_falls_back(target, drafters):
    router = Router(target, drafters)  # fallback "ngram:3"
    assert router.registered == {"de": "ngram:1", "fr": "ngram:2", "ja": "layerskip:1",
                                 "ru": "draft", "zh": "ngram:4"}
    for code, texts in SENTENCES.items():
        assert router.route(texts) == [(code, router.registered[code])] * len(texts)
    assert router.route([SPANISH, ITALIAN, "12345"]) == [
        ("es", "ngram:3"), ("it", "ngram:3"), ("und", "ngram:3")]

    # One mixed batch: rows of a drafter are decoded together, results come back in order.
    sources = [SENTENCES["de"][0], SPANISH, SENTENCES["ja"][1], SENTENCES["fr"][2],
               SENTENCES["zh"][0], SENTENCES["ru"][1], SENTENCES["de"][2], ITALIAN]
    rng = np.random.default_rng(0)
    prompts = []
    for n in (5, 9, 6, 12, 7, 10, 8, 11):
        half = rng.integers(0, 64, n // 2 + 1).tolist()
        prompts.append((half + half)[:n])  # repeats, so n-gram lookup finds drafts
    budgets = [12, 9, 12, 7, 12, 10, 5, 12]
    res = router.generate(prompts, sources=sources, gamma=3, max_new_tokens=budgets)
    greedy = jaxspec.generate(target, prompts, max_new_tokens=budgets)
    assert res.languages == ["de", "es", "ja", "fr", "zh", "ru", "de", "it"]
    assert res.drafters == ["ngram:1", "ngram:3", "layerskip:1", "ngram:2", "ngram:4", "draft",
                            "ngram:1", "ngram:3"]
    assert res.token_ids == greedy.token_ids
    assert [len(t) for t in res.token_ids] == budgets
    assert {g.drafter: g.rows for g in res.groups} == {
        "ngram:1": [0, 6], "ngram:3": [1, 7], "layerskip:1": [2], "ngram:2": [3],
        "ngram:4": [4], "draft": [5]}
    for b, row in enumerate(res.accept_lengths):
        assert sum(row) == len(res.token_ids[b])
    assert res.tau == pytest.approx(np.mean([a for row in res.accept_lengths for a in row]))


def test_missing_drafter_fails_at_registration(target, tmp_path, monkeypatch):
    missing = tmp_path / "no-such-drafter"
    with pytest.raises(FileNotFoundError, match="no-such-drafter.*'de'|'de'.*no-such-drafter"):
        Router(target, {"de": missing})
    # A registered name whose files are not installed.
    monkeypatch.setitem(loading.REGISTRY, "tiny-xxen-drafter", loading._shipped("tiny-xxen"))
    with pytest.raises(FileNotFoundError, match="tiny-xxen-drafter.*missing"):
        Router(target, {"fr": "tiny-xxen-drafter"})
    with pytest.raises(FileNotFoundError, match="fallback"):
        Router(target, {}, fallback=str(missing))
    with pytest.raises(UserError, match="ISO 639-1"):
        Router(target, {"xx": "ngram:2"})


def test_drafter_for_another_target_fails_at_registration(target, tiny, tmp_path):
    other = tiny.model(tiny.config(vocab_size=32), 5, "other")
    with pytest.raises(UserError, match="'ru'.*vocabulary"):
        Router(target, {"ru": other})
    # The same as a saved drafter: a path that loads but cannot serve this target.
    store.save(tmp_path / "other-drafter", other.params, other.config)
    with pytest.raises(UserError, match="other-drafter.*vocabulary"):
        Router(target, {"ja": tmp_path / "other-drafter"})
    # A hidden-state head trained for another target.
    heads.save(tmp_path / "other-head", "eagle", {"w": np.zeros((2, 2), np.float32)}, [0, 1],
               other, depth=1)
    with pytest.raises(UserError, match="other-head.*vocab_size 32"):
        Router(target, {"zh": str(tmp_path / "other-head")})
