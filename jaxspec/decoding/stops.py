"""Stop strings and ids as data for the decode loop (`speculative.Stops`), and the host's rule
for where a row's text ends.

A row ends at the first token that is an end-of-sequence or stop id, or whose text completes a
stop string, inside the token ("\\n" in a "\\n\\n" token) or spelled over several tokens. Each
stop string s of 2+ characters runs a KMP-style automaton over tokens: its state is the length of
the longest suffix of the row's generated text that is a proper prefix of s, and each token's
transitions come from its text as it reads after another token (special tokens have none).

The host's rule (`cut`) is the truth: the text ends before the first stop string in it, the ids
with the token that completed it. The loop stops rows there and never earlier; a token whose text
the tables cannot know alone (one byte of a character) lets its row run on, and `cut` trims it.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np

from jaxspec.decoding.speculative import Stops
from jaxspec.errors import UserError


def tables(model, stop) -> tuple[Stops, tuple[str, ...]]:
    """(the loop's stop data, as host arrays; the stop strings) for `stop`: None, a string, an
    int id, or a list of them. The model's end-of-sequence ids always stop."""
    ids, strings = _parse(model, stop)
    V = model.config.vocab_size
    if strings:
        ends_V, next_ZxVxL = _string_tables(model.tokenizer, strings, V)
    else:
        ends_V, next_ZxVxL = np.zeros(V, bool), np.zeros((0, V, 0), np.int8)
    ends_V = ends_V.copy()
    ends_V[list(ids)] = True
    return Stops(ends_V, next_ZxVxL), strings


def strings(model, stop) -> tuple[str, ...]:
    """The stop strings of `stop` (its ids and special tokens left out)."""
    return _parse(model, stop)[1]


def _parse(model, stop) -> tuple[set[int], tuple[str, ...]]:
    """(stop ids with the model's end-of-sequence ids, stop strings). A string that is one special
    token (such as "<end_of_turn>", which has no text) is its id."""
    tok, V = model.tokenizer, model.config.vocab_size
    ids = set(model.config.eos_token_ids)
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    strings = []
    for s in [stop] if isinstance(stop, (str, int, np.integer)) else _items(stop):
        if isinstance(s, str):
            if not s:
                raise UserError("empty stop string")
            if tok is None:
                raise UserError(f"stop string {s!r} needs a model with a tokenizer; pass ids")
            enc = tok.encode(s, add_special_tokens=False)
            if len(enc) == 1 and enc[0] < len(tok) and not token_texts(tok)[enc[0]]:
                ids.add(enc[0])
            elif s not in strings:
                strings.append(s)
        elif isinstance(s, (int, np.integer)) and not isinstance(s, bool) and 0 <= s < V:
            ids.add(int(s))
        else:
            raise UserError(f"stop must be strings or token ids in [0, {V}), got {s!r}")
    return {i for i in ids if 0 <= i < V}, tuple(strings)


def _items(stop) -> list:
    if stop is None:
        return []
    if not isinstance(stop, (list, tuple, set, frozenset)):
        raise UserError(f"stop must be a string, a token id or a list of them, got {stop!r}")
    return list(stop)


@functools.lru_cache(maxsize=4)
def token_texts(tok) -> tuple[str, ...]:
    """Each token's text as it reads after another token: decode([a, t]) less decode([a]) (a
    lone sentencepiece token may lose its leading space); special tokens have none."""
    a = tok.encode("a", add_special_tokens=False)[0]
    backend = getattr(tok, "backend_tokenizer", None)  # the fast tokenizer's batch is ~2x faster
    decode = backend.decode_batch if backend is not None else tok.batch_decode
    pairs = decode([[a, t] for t in range(len(tok))], skip_special_tokens=True)
    anchor = decode([[a]], skip_special_tokens=True)[0]
    return tuple(p[len(anchor):] if p.startswith(anchor) else p for p in pairs)


@functools.lru_cache(maxsize=16)
def _string_tables(tok, strings: tuple[str, ...], vocab: int):
    """(ends_V: tokens whose text holds a stop string; next_ZxVxL: the automata of the strings of
    2+ characters, int8 or int16, -1 once the text holds the string)."""
    texts = token_texts(tok)[:vocab]
    texts += ("",) * (vocab - len(texts))
    ends_V = np.array([any(s in x for s in strings) for x in texts])
    long = [s for s in strings if len(s) > 1]
    L = max(map(len, long), default=0)
    next_ZxVxL = np.zeros((len(long), vocab, L), np.int8 if L < 128 else np.int16)
    for s, next_VxL in zip(long, next_ZxVxL):
        _automaton(texts, s, next_VxL)
    return ends_V, next_ZxVxL


def _automaton(texts, s: str, next_VxL) -> None:
    """Fill stop string s's transitions. A token with no text keeps the state; one that can move
    it off 0 (a substring of s, or ending with a prefix of s, or starting with a suffix of s, or
    holding s) gets its own row; every other token resets it to 0."""
    L = len(s)
    prefixes, suffixes = tuple(s[:k] for k in range(1, L)), tuple(s[k:] for k in range(1, L))
    parts = {s[i:j] for i in range(L) for j in range(i + 1, L + 1)}
    for t, x in enumerate(texts):
        if not x:
            next_VxL[t, :L] = np.arange(L)
        elif x in parts or x.endswith(prefixes) or x.startswith(suffixes) or s in x:
            next_VxL[t, :L] = [_step(s, q, x) for q in range(L)]


def _step(s: str, q: int, x: str) -> int:
    """The state after text x from state q: -1 if s[:q] + x holds s, else the length of its
    longest suffix that is a proper prefix of s."""
    y = s[:q] + x
    if s in y:
        return -1
    return next((k for k in range(min(len(s) - 1, len(y)), 0, -1) if y.endswith(s[:k])), 0)


def cut(tok, ids: list[int], strings: tuple[str, ...]) -> tuple[list[int], str]:
    """The host's rule: (`ids` up to the token whose text completes the first stop string, their
    text up to just before it); all of `ids` and their text without one."""
    decode = lambda n: tok.decode(ids[:n], skip_special_tokens=True)  # noqa: E731
    text = decode(len(ids))
    if _first(text, strings) is None:
        return ids, text
    n = bisect.bisect_left(range(len(ids) + 1), True,
                           key=lambda n: _first(decode(n), strings) is not None)
    text = decode(n)
    return ids[:n], text[:_first(text, strings)]


def _first(text: str, strings) -> int | None:
    """Where the earliest stop string in `text` starts (None: none there)."""
    return min((i for i in (text.find(s) for s in strings) if i >= 0), default=None)
