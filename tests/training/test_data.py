"""Sources, prompt templates, tokenisation, packing and the resumable batch iterator."""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from jaxspec.training import data

SPECBENCH = Path(__file__).parents[3] / "shared" / "data" / "specbench" / "deen_question.jsonl"


def test_translation_prompt_matches_the_benchmark():
    first = json.loads(SPECBENCH.read_text().splitlines()[0])["turns"][0]
    sentence = first.split(":", 1)[1]
    assert data.translation_prompt(sentence, "de", "en") == first
    assert data.translation_prompt(" Bonjour ", "fr") == "Translate French to English:Bonjour"
    with pytest.raises(ValueError, match="unknown language code 'xx'"):
        data.translation_prompt("a", "xx")


def test_specbench_source_reads_first_turns():
    records = data.read_specbench(SPECBENCH)
    assert len(records) == len(SPECBENCH.read_text().splitlines())
    assert records[0] == {"prompt": "Translate German to English:Obama empfängt Netanyahu"}


def test_sharegpt_json_and_jsonl(tmp_path):
    items = [{"conversations": [{"from": "system", "value": "be nice"},
                                {"from": "human", "value": "hi"},
                                {"from": "gpt", "value": "hello"}]},
             {"messages": [{"role": "user", "content": "q"}]},
             {"conversations": [{"from": "gpt", "value": "no user turn"}]}]
    want = [{"prompt": "hi", "response": "hello"}, {"prompt": "q"}]
    (tmp_path / "a.json").write_text(json.dumps(items))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(i) for i in items) + "\n")
    assert data.read_sharegpt(tmp_path / "a.json") == want
    assert data.read_sharegpt(tmp_path / "a.jsonl") == want


def test_text_sources(tmp_path):
    (tmp_path / "a.txt").write_text("eins\n\n zwei \n")
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n')
    assert data.read_text(tmp_path / "a.txt") == [{"text": "eins"}, {"text": "zwei"}]
    assert data.read_text(tmp_path / "a.jsonl", key="body") == [{"text": "x"}, {"text": "y"}]
    assert data.load_source({"type": "text", "path": str(tmp_path / "a.txt"), "limit": 1}) == [
        {"text": "eins"}]
    with pytest.raises(ValueError, match="unknown source type 'csv'"):
        data.load_source({"type": "csv"})


def test_prompts_and_texts_from_each_record_kind():
    records = [{"text": "Hallo Welt."}, {"source": "Guten Tag", "target": "Good day"},
               {"prompt": "Write.", "response": "Done."}]
    assert data.to_prompts(records, "de", "en") == [
        "Translate German to English:Hallo Welt.", "Translate German to English:Guten Tag",
        "Write."]
    assert data.to_texts(records) == ["Hallo Welt.", "Guten Tag", "Good day", "Write.\nDone."]
    with pytest.raises(ValueError, match="language pair"):
        data.to_prompts([{"text": "x"}])


def test_split_sentences_latin_and_cjk():
    assert data.split_sentences("Das ist gut. Wirklich? Ja!\n中文的句子。另一个句子！") == [
        "Das ist gut.", "Wirklich?", "中文的句子。", "另一个句子！"]


class FakeResult:
    def __init__(self, texts):
        self.texts = texts


def test_self_generated_text_uses_the_generate_function():
    calls = []

    def fake_generate(model, prompts, **kw):
        calls.append((list(prompts), kw))
        return FakeResult([f"Satz {i}. Noch einer!" for i in range(len(prompts))])

    records = data.self_generated("MODEL", "de", 3, fake_generate, seed=5, batch_size=2,
                                  max_new_tokens=7, check_language=False)
    assert [r["text"] for r in records] == ["Satz 0.", "Noch einer!", "Satz 1."]  # once each
    # A base model continues a header written in the language itself.
    assert calls[0][0] == [data.NATIVE_SEEDS["de"]] * 2
    assert [c[1]["seed"] for c in calls] == [5, 7]
    assert all(c[1]["max_new_tokens"] == 7 and c[1]["temperature"] == 1.0 for c in calls)
    # An instruction-tuned one (chat) is asked in English, topic by topic.
    calls.clear()
    data.self_generated("MODEL", "de", 2, fake_generate, chat=True, check_language=False)
    assert calls[0][0] == ["Write a short paragraph in German about the weather.",
                           "Write a short paragraph in German about a football match."]


def test_self_generated_text_keeps_distinct_sentences_of_its_language():
    """A base model drifts: English, repeats, runaway lines. Only distinct French sentences
    within the length limit stay (lingua decides the language)."""
    paragraph = ("<p>Le marché de la ville ouvre tous les <b>samedis</b> matin. The weather was nice "
                 "and everyone went outside. Le marché de la ville ouvre tous les samedis matin. "
                 + "Les enfants jouent dans le parc " * 12 + ".")

    def fake_generate(model, prompts, **kw):
        return FakeResult([paragraph] * len(prompts))

    records = data.self_generated("MODEL", "fr", 2, fake_generate, batch_size=2, max_chars=200)
    assert [r["text"] for r in records] == ["Le marché de la ville ouvre tous les samedis matin."]


def _fake_tfds(monkeypatch, examples):
    """A stand-in `tensorflow_datasets` whose data_source returns `examples`."""
    seen = {}

    def data_source(name, split, data_dir, download):
        seen.update(name=name, split=split, data_dir=data_dir, download=download)
        return examples

    tfds = types.ModuleType("tensorflow_datasets")
    tfds.data_source = data_source
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", tfds)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets.translate",
                        types.ModuleType("tensorflow_datasets.translate"))
    return seen


def test_tfds_source_with_a_stand_in_loader(monkeypatch):
    seen = _fake_tfds(monkeypatch, [{"de": b"Hallo", "en": b"Hello"}, {"de": "Ja", "en": "Yes"},
                                    {"de": "Nein", "en": "No"}])
    spec = {"type": "tfds", "name": "wmt16_translate/de-en", "source_lang": "de",
            "split": "validation", "data_dir": "/data", "limit": 2, "download": False}
    assert data.load_source(spec) == [{"source": "Hallo", "target": "Hello"},
                                      {"source": "Ja", "target": "Yes"}]
    assert seen == {"name": "wmt16_translate/de-en", "split": "validation", "data_dir": "/data",
                    "download": False}
    with pytest.raises(ValueError, match="not 'fr' and 'en'"):
        data.load_tfds("wmt16_translate/de-en", "fr")


def test_tfds_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'jaxspec\[tfds\]'"):
        data.load_tfds("wmt16_translate/de-en", "de")


@pytest.mark.parametrize("name, lang", [("wmt16_translate/de-en", "de"),
                                        ("wmt16_translate/ru-en", "ru"),
                                        ("wmt14_translate/fr-en", "fr"),
                                        ("wmt19_translate/zh-en", "zh")])
def test_tfds_mock_data(name, lang):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=4):
        records = data.load_tfds(name, lang, limit=3)
    assert len(records) == 3
    assert all(isinstance(r["source"], str) and isinstance(r["target"], str) for r in records)


def test_byte_tokenizer_round_trip_and_chat_template():
    tok = data.byte_tokenizer()
    ids = tok("Grüß dich").input_ids
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token_id == 2 and len(tok) == 259
    assert tok.decode(ids, skip_special_tokens=True) == "Grüß dich"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<bos><user>Hi\n<assistant>"


def test_text_examples_end_with_eos_and_skip_the_first_target():
    tok = data.byte_tokenizer()
    (ids, mask), = data.text_examples(tok, ["ab"], eos_id=2)
    assert ids == [1, tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b"), 2]
    assert mask == [0, 1, 1, 1]


def test_distilled_examples_mask_only_the_response():
    (ids, mask), = data.distilled_examples([{"prompt_ids": [1, 5, 6], "response_ids": [7, 2]}])
    assert ids == [1, 5, 6, 7, 2] and mask == [0, 0, 0, 1, 1]


def test_pack_keeps_examples_whole_and_masks_padding():
    examples = [([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1]), ([6, 7, 8], [0, 0, 1])]
    tokens, mask = data.pack(examples, seq_len=4, pad_id=0)  # rows of 5
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0, 1], [0, 0, 1, 0, 0]])
    assert tokens.dtype == mask.dtype == np.int32


def test_pack_cuts_long_examples_and_drops_the_cut_targets():
    tokens, mask = data.pack([(list(range(10, 17)), [0, 1, 1, 1, 1, 1, 1])], seq_len=3, pad_id=9)
    np.testing.assert_array_equal(tokens, [[10, 11, 12, 13], [14, 15, 16, 9]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 1, 1, 0]])
    with pytest.raises(ValueError, match="2 tokens and 1 mask"):
        data.pack([([1, 2], [1])], 4, 0)


def test_batches_cover_each_epoch_and_resume_exactly():
    tokens = np.arange(10, dtype=np.int32)[:, None] * np.ones((1, 3), np.int32)
    mask = np.ones_like(tokens)
    a = data.Batches(tokens, mask, batch_size=3, seed=1)
    epoch0 = [a.next()["tokens"][:, 0] for _ in range(3)]
    assert sorted(np.concatenate(epoch0)) == sorted(set(np.concatenate(epoch0)))  # no repeats
    assert a.state == {"epoch": 0, "index": 9}
    b = data.Batches(tokens, mask, batch_size=3, seed=1)
    b.restore(json.loads(json.dumps(a.state)))
    for _ in range(5):  # crosses into epochs 1 and 2
        np.testing.assert_array_equal(a.next()["tokens"], b.next()["tokens"])
    assert a.state["epoch"] == 2
    assert not np.array_equal(a._order(), data.Batches(tokens, mask, 3, seed=1)._order())
    with pytest.raises(ValueError, match="fewer than one batch"):
        data.Batches(tokens[:2], mask[:2], batch_size=3)


def test_manpages_source_reads_prose_paragraphs(tmp_path):
    page = tmp_path / "de" / "man1" / "beispiel.1"
    page.parent.mkdir(parents=True)
    page.write_text(".TH BEISPIEL 1\n.SH BESCHREIBUNG\nDieses Programm liest Dateien und schreibt "
                    "sie\nin einer anderen Form wieder hinaus.\n.PP\nKurz.\n.SH OPTIONEN\n"
                    ".TP\n\\-v\nmehr Ausgaben\n", encoding="utf-8")
    records = data.load_source({"type": "manpages", "language": "de", "root": str(tmp_path)})
    # Filled lines join into one paragraph; the heading, "Kurz." and the option are left out.
    assert records == [{"text": "Dieses Programm liest Dateien und schreibt sie in einer anderen "
                                "Form wieder hinaus."}]
    with pytest.raises(data.UserError, match="no manual pages"):
        data.read_manpages("fr", root=tmp_path)


def test_manpages_source_says_what_it_needs_without_man(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(data.UserError, match="install man-db"):
        data.read_manpages("de", root=tmp_path)
