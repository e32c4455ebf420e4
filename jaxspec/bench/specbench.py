"""Spec-Bench runner: questions -> one `model_answer` JSONL per method -> report.

Methods (`--methods`):
  ar                    jaxspec.generate (the baseline)
  ar:int8               jaxspec.generate on the target loaded with int8 weights
  ngram[:N]             prompt lookup, n-grams up to N (default 3)
  layerskip:SPEC        the target with layers skipped; SPEC like "10-19" or "3,5,7"
  drafter:PATH          a trained jaxspec drafter (checkpoint dir, HF dir or GGUF)
  ...+ngram[:N[:K]]     layerskip or drafter, drafting staged with n-gram lookup
  lookahead[:W[:N[:G]]] Lookahead decoding (its own tree: once per temperature)
  hf                    transformers `generate`, PyTorch fp32, on the same weights
  hf-assisted:PATH      transformers assisted generation with that drafter
  llama.cpp             llama.cpp on the target's GGUF (the `llamacpp` extra; skipped without it)
  llama.cpp-lookup      llama.cpp with its prompt-lookup speculation
Each runs at every gamma (speculative methods) and temperature given. Answer files are appended
one question at a time, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from pathlib import Path
from typing import Sequence

from tqdm.auto import tqdm

from jaxspec.decoding.trees import DynamicTree
from jaxspec.errors import UserError
from jaxspec.questions import append_answer, done_question_ids, image_paths, read_questions

KINDS = ("ar", "ngram", "layerskip", "drafter", "lookahead", "hf", "hf-assisted", "llama.cpp",
         "llama.cpp-lookup")
SPECULATIVE = ("ngram", "layerskip", "drafter", "hf-assisted")


@dataclasses.dataclass(frozen=True)
class Method:
    kind: str
    arg: str | None = None
    gamma: int | str = 0  # or "auto"
    temperature: float = 0.0
    tree: tuple[tuple[int, ...], ...] | DynamicTree | None = None  # instead of gamma

    @property
    def name(self) -> str:
        arg = "" if self.arg is None else "-" + Path(self.arg).name.replace(",", "_").replace(
            ":", "-")
        gamma = f"-g{self.gamma}" if self.gamma else ""
        if isinstance(self.tree, DynamicTree):
            t = self.tree
            gamma = f"-dyn{t.budget}d{t.depth}w{t.width}"
        elif self.tree:
            gamma = f"-tree{len(self.tree)}d{max(map(len, self.tree))}"
        return f"{self.kind}{arg}{gamma}-t{self.temperature:g}"


def parse_methods(specs: Sequence[str], gammas: Sequence[int | str],
                  temperatures: Sequence[float], tree=None) -> list[Method]:
    """Methods for every spec and temperature: speculative ones at every gamma and, given a
    `tree` (paths), with that tree too."""
    out = []
    for spec in specs:
        kind, _, arg = spec.partition(":")
        arg, staged, _ = arg.partition("+")  # "+ngram...": the second stage, parse_drafter's
        if staged and kind not in ("layerskip", "drafter"):
            raise UserError(f"method {spec!r}: only layerskip and drafter draft staged")
        if kind not in KINDS:
            raise UserError(f"unknown method {spec!r}; methods are {', '.join(KINDS)}")
        if kind in ("layerskip", "drafter", "hf-assisted") and not arg:
            raise UserError(f"method {kind} needs an argument: {kind}:...")
        if kind == "ar" and arg not in ("", "int8"):
            raise UserError(f"method {spec!r}: ar takes no argument or ar:int8")
        if kind in ("drafter", "hf-assisted"):
            from jaxspec.loading import REGISTRY

            if not Path(arg).exists() and arg not in REGISTRY:
                raise FileNotFoundError(f"drafter {arg!r} (method {spec}) does not exist: it "
                                        f"is neither a path nor a registered name")
        if kind == "layerskip":
            from jaxspec.loading import parse_layers

            parse_layers(arg)
        if tree and kind == "hf-assisted":
            raise UserError("hf-assisted does not verify token trees")
        for t in temperatures:
            full = spec.partition(":")[2] or None
            for g in (gammas if kind in SPECULATIVE else [0]):  # lookahead: its own tree
                out.append(Method(kind, full, g, float(t)))
            if tree and kind in SPECULATIVE and not staged:
                out.append(Method(kind, full, 0, float(t), tree if isinstance(tree, DynamicTree)
                                  else tuple(map(tuple, tree))))
    names = collections.Counter(m.name for m in out)
    if clash := sorted(n for n, k in names.items() if k > 1):
        # Each method's answers live in <name>.jsonl: two with one name would share a file.
        raise UserError(f"methods {', '.join(clash)} appear twice (two drafter paths ending in "
                        f"the same folder name?); give each drafter its own folder name")
    return out


class _JaxRunner:
    def __init__(self, target, method: Method, chat: bool, stop, image_placeholder=None):
        from jaxspec.loading import parse_drafter

        self.target, self.method, self.chat, self.stop = target, method, chat, stop
        self.image_placeholder = image_placeholder
        self.drafter = None
        if method.kind != "ar":
            self.drafter = parse_drafter(f"{method.kind}:{method.arg or ''}", target)

    def __call__(self, prompt: str, max_new_tokens: int, seed: int, remember: bool = True,
                 images=None):
        """`remember`: whether gamma "auto" keeps what this call measured (not a warm-up's);
        `images`: the prompt's image files (a vision-language target)."""
        import jaxspec

        kw = dict(max_new_tokens=max_new_tokens, temperature=self.method.temperature, seed=seed,
                  stop=self.stop, chat=self.chat, images=[images] if images else None)
        if self.drafter is None:
            r = jaxspec.generate(self.target, [prompt], **kw)
        else:
            r = jaxspec.speculative_generate(self.target, self.drafter, [prompt],
                                             gamma=self.method.gamma or None,
                                             tree=self.method.tree, remember=remember,
                                             image_placeholder=self.image_placeholder, **kw)
        return r.texts[0], len(r.token_ids[0]), r.wall_time_s, r.accept_lengths[0], \
            r.compile_time_s


def run_bench(target: str, questions: str, methods: Sequence[Method], out_dir: str, *,
              max_new_tokens: int = 64, template: str = "{prompt}", chat: bool = False,
              stop=None, limit: int | None = None, seed: int = 0,
              dtype: str = "auto", mesh=None, image_placeholder=None) -> dict[str, Path]:
    """Answer every question with every method; returns {method name: answer file}. The
    methods take turns on each question, so a burst of noise on the machine (minutes long on
    this shared CPU: the same method measured 10.1 s and 12.6 s in two runs) falls on all of
    them rather than on one. With a `mesh`, the target is loaded onto it and decodes over it.
    `image_placeholder`: what drafters read in place of the questions' images (none: dropped)."""
    import jaxspec

    qs = read_questions(questions)[:limit]
    images = {q["question_id"]: image_paths(questions, q) for q in qs}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = jaxspec.load(target, dtype=dtype, mesh=mesh)
    if any(m.kind.startswith("llama.cpp") for m in methods):
        from jaxspec.bench.llama_cpp import missing

        if why := missing():
            print(f"jaxspec bench: skipping the llama.cpp rows: {why}", file=sys.stderr)
            methods = [m for m in methods if not m.kind.startswith("llama.cpp")]
    files = {m.name: out / f"{m.name}.jsonl" for m in methods}
    done = {m.name: done_question_ids(files[m.name]) for m in methods}
    runners = {}
    for m in methods:
        todo = [q for q in qs if q["question_id"] not in done[m.name]]
        if not todo:
            continue
        if any(images.values()) and (m.kind.startswith(("hf", "llama.cpp"))
                                     or (m.kind == "ar" and m.arg == "int8")):
            raise UserError(f"method {m.name} does not take images; the questions hold some")
        if m.kind.startswith("hf"):
            from jaxspec.bench.hf_baseline import HFRunner
            runners[m.name] = HFRunner(target, model, m, chat, stop)
        elif m.kind.startswith("llama.cpp"):
            from jaxspec.bench.llama_cpp import LlamaCppRunner
            runners[m.name] = LlamaCppRunner(target, m.kind.endswith("lookup"), chat, stop)
        elif m.kind == "ar" and m.arg == "int8":
            runners[m.name] = _JaxRunner(jaxspec.load(target, dtype="int8"), m, chat, stop)
        else:
            runners[m.name] = _JaxRunner(model, m, chat, stop, image_placeholder)
        warm_up = template.format(prompt=todo[0]["turns"][0])
        # Compiles on the first question: gamma "auto" must not learn from it before timing it.
        kw = ({"remember": False, "images": images[todo[0]["question_id"]]}
              if isinstance(runners[m.name], _JaxRunner) else {})
        runners[m.name](warm_up, max_new_tokens, seed, **kw)
    for q in tqdm(qs, desc=", ".join(runners) or "done", unit="q", file=sys.stderr):
        for m in methods:
            if m.name not in runners or q["question_id"] in done[m.name]:
                continue
            turns, new, wall, accept, compile_s = [], [], [], [], 0.0
            for i, turn in enumerate(q["turns"]):  # the images go with the first turn
                kw = {"images": images[q["question_id"]]} if i == 0 and images[
                    q["question_id"]] else {}
                text, n, t, acc, c = runners[m.name](template.format(prompt=turn),
                                                     max_new_tokens, seed, **kw)
                turns.append(text), new.append(n), wall.append(t), accept.extend(acc)
                compile_s += c
            record = {"question_id": q["question_id"], "category": q["category"],
                      "model_id": m.name, "tstamp": time.time(), "compile_time_s": compile_s,
                      "choices": [{"index": 0, "turns": turns, "new_tokens": new,
                                   "wall_time": wall, "accept_lengths": accept}]}
            if m.gamma:
                record["gamma"] = m.gamma
            append_answer(files[m.name], record)
    return files
