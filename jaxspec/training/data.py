"""Training data: sources, prompt templates, tokenisation, packing, and a resumable iterator.

A source yields records, plain dicts of one of three kinds:
  {"text": ...}                    monolingual text
  {"source": ..., "target": ...}   a translation pair
  {"prompt": ..., "response": ...} a prompt, with a response when the source has one
`to_prompts` turns any of them into prompts for distillation, `to_texts` into text for pretraining.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxspec.decoding.api import generate
from jaxspec.errors import UserError
from jaxspec.files import read_jsonl

LANGUAGES = {"de": "German", "en": "English", "fr": "French", "ja": "Japanese", "ru": "Russian",
             "zh": "Chinese", "es": "Spanish", "it": "Italian", "cs": "Czech", "fi": "Finnish"}

# Seeds for text a base model writes in a language: a header in that language.
NATIVE_SEEDS = {"en": "An article from an English newspaper:\n\n",
                "de": "Ein Artikel aus einer deutschen Zeitung:\n\n",
                "fr": "Un article d'un journal français :\n\n",
                "ja": "日本の新聞の記事：\n\n",
                "ru": "Статья из российской газеты:\n\n",
                "zh": "一篇中文报纸的文章：\n\n"}

# Seed topics for text an instruction-tuned target writes itself in the source language.
TOPICS = ("the weather", "a football match", "the economy", "a new film", "cooking dinner",
          "a train journey", "local elections", "a science discovery", "a music festival",
          "city traffic", "a family holiday", "a history museum")


def language_name(code: str) -> str:
    if code not in LANGUAGES:
        raise UserError(f"unknown language code {code!r}; known: {sorted(LANGUAGES)}")
    return LANGUAGES[code]


def translation_prompt(sentence: str, source_lang: str, target_lang: str = "en") -> str:
    """The benchmark's prompt: "Translate German to English:" followed by the sentence."""
    return (f"Translate {language_name(source_lang)} to {language_name(target_lang)}:"
            f"{sentence.strip()}")


# ---------------------------------------------------------------- sources


def load_tfds(name: str, source_lang: str, target_lang: str = "en", split: str = "train",
              data_dir: str | None = None, limit: int | None = None,
              download: bool = True) -> list[dict]:
    """Translation pairs from a TFDS dataset such as "wmt16_translate/de-en" (any name/config
    whose examples hold one text per language), read through `tfds.data_source`."""
    try:
        import tensorflow_datasets as tfds
        import tensorflow_datasets.translate  # noqa: F401  (registers the WMT builders)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"TFDS sources need tensorflow-datasets ({e.name} is missing): "
                                  f"pip install 'jaxspec[tfds]'") from None
    ds = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    n = len(ds) if limit is None else min(limit, len(ds))
    records = []
    for i in range(n):
        ex = ds[i]
        if source_lang not in ex or target_lang not in ex:
            raise UserError(f"{name}: examples have fields {sorted(ex)}, not "
                            f"{source_lang!r} and {target_lang!r}")
        records.append({"source": _str(ex[source_lang]), "target": _str(ex[target_lang])})
    return records


def _str(x) -> str:
    return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def read_specbench(path: str | Path) -> list[dict]:
    """First turn of each question of a Spec-Bench `question.jsonl`, as prompts."""
    from jaxspec.questions import read_questions

    return [{"prompt": q["turns"][0]} for q in read_questions(path)]


def read_sharegpt(path: str | Path) -> list[dict]:
    """First user turn and the reply to it, from ShareGPT-style JSON (a list) or JSONL."""
    text = Path(path).read_text(encoding="utf-8")
    items = (json.loads(text) if text.lstrip().startswith("[") else
             [obj for _, obj in read_jsonl(path)])
    records = []
    for item in items:
        turns = item.get("conversations") or item.get("messages") or []
        roles = [t.get("from", t.get("role")) for t in turns]
        texts = [t.get("value", t.get("content")) for t in turns]
        for i, role in enumerate(roles):
            if role in ("human", "user"):
                rec = {"prompt": texts[i]}
                if i + 1 < len(turns) and roles[i + 1] in ("gpt", "assistant"):
                    rec["response"] = texts[i + 1]
                records.append(rec)
                break
    if not records:
        raise UserError(f"{path}: no conversation with a user turn")
    return records


def read_text(path: str | Path, key: str = "text") -> list[dict]:
    """Plain text (one text per non-empty line) or JSONL (field `key` of each object)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return [{"text": obj[key]} for _, obj in read_jsonl(path)]
    return [{"text": ln.strip()} for ln in path.read_text(encoding="utf-8").splitlines()
            if ln.strip()]


MAN_ROOT = Path("/usr/share/man")


def read_manpages(language: str, limit: int | None = None, root: str | Path = MAN_ROOT,
                  min_chars: int = 40) -> list[dict]:
    """Real text in `language` that ships with the machine: the prose paragraphs of the
    installed manual pages (`root/<language>/man*/`, or `root/man*/` for "en"), rendered by
    man-db, one paragraph per record (headings, option lists and paragraphs under `min_chars`
    characters left out), pages in name order, at most `limit` pages. Each page's licence is its
    package's (`/usr/share/doc/<package>/copyright`)."""
    import shutil
    import subprocess

    if shutil.which("man") is None or shutil.which("col") is None:
        raise UserError("the manpages source renders pages with man-db's `man` and `col`, and "
                        "this machine has neither on PATH: install man-db, or use another source")
    base = Path(root) if language == "en" else Path(root) / language
    pages = sorted(p for p in base.glob("man[1-8]/*") if p.is_file())[:limit]
    if not pages:
        raise UserError(f"no manual pages under {base}: install the language's manpages "
                        f"package, or use another source")
    env = {"MANWIDTH": "100000", "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"}
    records = []
    for page in pages:
        run = subprocess.run(["man", "-E", "UTF-8", "-l", str(page)], capture_output=True,
                             env=env, timeout=60)
        text = subprocess.run(["col", "-bx"], input=run.stdout, capture_output=True,
                              env=env).stdout.decode("utf-8", "replace")
        for para in text.split("\n"):
            para = " ".join(para.split())
            if len(para) >= min_chars and para[-1:] in ".!?。！？:)":
                records.append({"text": para})
    return records


def split_sentences(text: str, min_chars: int = 4) -> list[str]:
    """Sentences of `text` (split after . ! ? and their CJK forms), at least `min_chars` long."""
    parts = re.split(r"(?<=[.!?。！？])\s*|\n+", text)
    return [p.strip() for p in parts if len(p.strip()) >= min_chars]


_MARKUP = re.compile(r"</?[A-Za-z][^<>]*>")


def self_generated(model, language: str, num_texts: int, generate_fn: Callable | None = None,
                   seed: int = 0, max_new_tokens: int = 128, temperature: float = 1.0,
                   batch_size: int = 8, chat: bool = False, min_chars: int = 4,
                   max_chars: int = 300, check_language: bool = True) -> list[dict]:
    """Monolingual text the model writes in `language` from seed prompts (one paragraph per
    prompt, split into sentences), so a recipe runs offline with no corpus. Sentences are kept
    once each, between `min_chars` and `max_chars` long, and (`check_language`) only those
    lingua detects as `language` (`routing.detect_language`), so a base model drifting into
    English does not become a source sentence; HTML tags are removed first."""
    generate_fn = generate_fn or generate
    lang = language_name(language)
    if chat or language not in NATIVE_SEEDS:
        prompts = [f"Write a short paragraph in {lang} about {TOPICS[i % len(TOPICS)]}."
                   for i in range(num_texts)]
    else:  # a base model continues a header in the language; sampling seeds give variety
        prompts = [NATIVE_SEEDS[language]] * num_texts
    from tqdm.auto import tqdm

    records = []
    for start in tqdm(range(0, num_texts, batch_size), desc=f"writing {lang} text", unit="batch",
                      file=sys.stderr):
        out = generate_fn(model, prompts[start:start + batch_size], max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed + start, chat=chat)
        for text in out.texts:  # without markup (base models write HTML tags)
            text = re.sub(r"[ \t]{2,}", " ", _MARKUP.sub(" ", text))
            records.extend({"text": s} for s in split_sentences(text, min_chars))
    records = [r for r in {r["text"]: r for r in records}.values() if len(r["text"]) <= max_chars]
    if check_language and records:
        from jaxspec.decoding.routing import detect_language

        found = detect_language([r["text"] for r in records])
        kept = [r for r, code in zip(records, found) if code == language]
        print(f"jaxspec: {len(kept)} of {len(records)} {lang} sentences kept (distinct, "
              f"{min_chars}-{max_chars} chars, detected as {language})", file=sys.stderr)
        records = kept
    return records


def load_source(spec: dict, model=None, generate_fn: Callable | None = None) -> list[dict]:
    """Records from a source spec: {"type": "tfds" | "specbench" | "sharegpt" | "text" |
    "manpages" | "selfgen", ...keyword arguments of the matching reader}."""
    spec = dict(spec)
    kind = spec.pop("type", None)
    readers = {"tfds": load_tfds, "specbench": read_specbench, "sharegpt": read_sharegpt,
               "text": read_text, "manpages": read_manpages}
    if kind == "selfgen":
        if model is None:
            raise UserError("a selfgen source needs the target model")
        return self_generated(model, generate_fn=generate_fn, **spec)
    if kind not in readers:
        raise UserError(f"unknown source type {kind!r}; use one of "
                        f"{sorted([*readers, 'selfgen'])}")
    limit = spec.pop("limit", None) if kind != "tfds" else None
    records = readers[kind](**spec)
    return records[:limit] if limit is not None else records


def to_prompts(records: Iterable[dict], source_lang: str | None = None,
               target_lang: str = "en") -> list[str]:
    """Prompts: a record's own prompt, or its source/text inside the translation template."""
    prompts = []
    for r in records:
        if "prompt" in r:
            prompts.append(r["prompt"])
            continue
        if source_lang is None:
            raise UserError("text records need a language pair to become translation prompts")
        prompts.append(translation_prompt(r.get("source", r.get("text", "")), source_lang,
                                          target_lang))
    return prompts


def to_texts(records: Iterable[dict]) -> list[str]:
    """Text to pretrain on: each text, both sides of a pair, a prompt followed by its response."""
    texts = []
    for r in records:
        if "text" in r:
            texts.append(r["text"])
        elif "source" in r:
            texts.extend([r["source"], r["target"]])
        else:
            texts.append(r["prompt"] + ("\n" + r["response"] if r.get("response") else ""))
    return texts


# ---------------------------------------------------------------- tokenisation and packing

Example = tuple[list[int], list[int]]  # token ids, loss mask (1: the token is predicted)


def text_examples(tokenizer, texts: Sequence[str], eos_id: int) -> list[Example]:
    """Each text tokenised and ended by EOS; every token but the first is a loss target."""
    out = []
    for ids in tokenizer(list(texts)).input_ids:
        ids = list(ids) + [eos_id]
        out.append((ids, [0] + [1] * (len(ids) - 1)))
    return out


def distilled_examples(records: Iterable[dict]) -> list[Example]:
    """Prompt ids then response ids; only the response tokens are loss targets."""
    return [(list(r["prompt_ids"]) + list(r["response_ids"]),
             [0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"])) for r in records]


def pack(examples: Sequence[Example], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Whole examples packed greedily, in order, into rows of seq_len + 1 tokens (inputs and
    shifted targets), padded with `pad_id` and mask 0. An example longer than a row is cut into
    row-sized chunks whose first tokens are not loss targets (their context is gone).

    Returns tokens_RxL, mask_RxL (int32) with L = seq_len + 1.
    """
    L = seq_len + 1
    rows, masks, row, mask = [], [], [], []
    for ids, m in examples:
        if len(ids) != len(m):
            raise ValueError(f"example has {len(ids)} tokens and {len(m)} mask entries")
        for start in range(0, len(ids), L):
            chunk, chunk_mask = ids[start:start + L], list(m[start:start + L])
            if start:
                chunk_mask[0] = 0
            if len(row) + len(chunk) > L:
                rows.append(row), masks.append(mask)
                row, mask = [], []
            row, mask = row + chunk, mask + chunk_mask
    if row:
        rows.append(row), masks.append(mask)
    tokens_RxL = np.full((len(rows), L), pad_id, np.int32)
    mask_RxL = np.zeros((len(rows), L), np.int32)
    for i, (r, m) in enumerate(zip(rows, masks)):
        tokens_RxL[i, :len(r)] = r
        mask_RxL[i, :len(m)] = m
    return tokens_RxL, mask_RxL


class Batches:
    """Batches of packed rows, reshuffled every epoch from (seed, epoch); the position
    {"epoch", "index"} is saved with a checkpoint so a resumed run sees the same batches."""

    def __init__(self, tokens_RxL: np.ndarray, mask_RxL: np.ndarray, batch_size: int,
                 seed: int = 0, **extra: np.ndarray):
        if len(tokens_RxL) < batch_size:
            raise UserError(f"{len(tokens_RxL)} packed rows are fewer than one batch of "
                            f"{batch_size}; add data or lower the batch size")
        for k, v in extra.items():
            if len(v) != len(tokens_RxL):
                raise ValueError(f"{k} has {len(v)} rows, tokens {len(tokens_RxL)}")
        self.tokens_RxL, self.mask_RxL, self.extra = tokens_RxL, mask_RxL, extra
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.index = 0, 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.tokens_RxL))

    def next(self) -> dict[str, np.ndarray]:
        """{"tokens": [batch, L], "mask": [batch, L], and each extra array's rows}; the last
        partial batch of an epoch is dropped."""
        if self.index + self.batch_size > len(self.tokens_RxL):
            self.epoch, self.index = self.epoch + 1, 0
        rows = self._order()[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        return {"tokens": self.tokens_RxL[rows], "mask": self.mask_RxL[rows],
                **{k: v[rows] for k, v in self.extra.items()}}

    @property
    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def byte_tokenizer():
    """A byte-level tokenizer (<pad>=0, <bos>=1, <eos>=2, then 256 bytes) with a small chat
    template, for tiny random models in tests and notebooks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>"
                          "{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    return fast
