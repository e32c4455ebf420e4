"""`jaxspec demo`: translate into English from five languages with speculative decoding on the
embedded Gemma 3 270M, and check every output against plain greedy decoding."""

from __future__ import annotations

import sys

# One-shot prompts: Gemma 3 270M is a base model, so an example sets the format.
EXAMPLES = {
    "German": ("Ich trinke jeden Morgen einen Kaffee.", "I drink a coffee every morning."),
    "French": ("Je bois un café tous les matins.", "I drink a coffee every morning."),
    "Japanese": ("私は毎朝コーヒーを飲みます。", "I drink a coffee every morning."),
    "Russian": ("Я пью кофе каждое утро.", "I drink a coffee every morning."),
    "Chinese": ("我每天早上喝一杯咖啡。", "I drink a coffee every morning."),
}
SENTENCES = {
    "German": "Die Stadt hat im letzten Jahr drei neue Schulen gebaut.",
    "French": "Le train pour Paris part à huit heures du matin.",
    "Japanese": "明日は雨が降るので、傘を持って行ってください。",
    "Russian": "Мой брат работает врачом в большой больнице.",
    "Chinese": "这家餐厅的菜非常好吃，而且价格也不贵。",
}
TEMPLATE = "Translate {lang} to English.\n{lang}: {src_ex}\nEnglish: {tgt_ex}\n{lang}: {src}\nEnglish:"


def prompt(lang: str, sentence: str) -> str:
    src_ex, tgt_ex = EXAMPLES[lang]
    return TEMPLATE.format(lang=lang, src_ex=src_ex, tgt_ex=tgt_ex, src=sentence)


FALLBACK = "ngram:3"  # n-gram prompt lookup: needs no training


def make_router(model, target: str, drafter: str | None = None):
    """A Router for `model`: `drafter` (as for parse_drafter) forced for every language, else the
    target's shipped drafters and n-gram lookup for the other languages. Every drafter is loaded
    here, so a missing one fails before any decoding."""
    from jaxspec.decoding.routing import Router

    from jaxspec.loading import SHIPPED

    if drafter:
        return Router(model, {}, fallback=drafter)
    return Router(model, SHIPPED.get(target, {}), fallback=FALLBACK)


def run(target: str = "gemma3-270m", drafter: str | None = None, gamma: int | str = "auto",
        max_new_tokens: int = 48, out=None, dtype: str = "bfloat16",
        repeats: int = 3, quick: bool = False) -> list[dict]:
    """bfloat16 weights by default: on CPU they make verifying several positions cost about what
    one does (`docs/results/verification-cost.md`); "identical" compares with greedy decoding of
    the same weights. gamma "auto" lets each step pick its draft length from the cost model.
    Each sentence is decoded `repeats` times each way, in turn; tokens/s is from the fastest.
    Every run starts without gamma auto's history (`remember=False`): a repeat does not learn
    from the one before it on the same sentence. `quick`: each sentence once each way, then the
    other embedded model (SmolLM2, n-gram lookup) on the German sentence: every model and
    drafter the main job needs, loaded and checked (CI's check of a fresh install)."""
    import jaxspec

    out = out or sys.stdout
    model = jaxspec.load(target, dtype=dtype)
    router = make_router(model, target, drafter)
    routes = [f"{c} -> {d}" for c, d in router.registered.items()]
    routes.append(f"{'every language' if drafter else 'other languages'} -> {router.fallback}")
    print(f"target: {target} ({dtype})   gamma: {gamma}\ndrafters: {', '.join(routes)}",
          file=out)
    rows = []
    for lang, sentence in SENTENCES.items():
        p = prompt(lang, sentence)
        bases, specs = [], []
        for _ in range(1 if quick else repeats):
            bases.append(jaxspec.generate(model, [p], max_new_tokens=max_new_tokens, stop="\n"))
            # The language is detected on the sentence: the prompt's template is English.
            specs.append(router.generate([p], sources=[sentence], gamma=gamma,
                                         max_new_tokens=max_new_tokens, stop="\n",
                                         remember=False))
        base = min(bases, key=lambda r: r.wall_time_s)
        spec = min(specs, key=lambda r: r.wall_time_s)
        code, desc = spec.languages[0], spec.drafters[0]
        if not drafter and code not in router.registered:
            desc += f" (no trained drafter for '{code}': n-gram fallback)"
        drafted = spec.draft_lengths[0]
        row = {"language": lang, "detected": code, "drafter": desc, "source": sentence,
               "translation": spec.texts[0].strip(),
               "tau": spec.tau, "draft_lengths": drafted,
               "mean_gamma": sum(drafted) / max(len(drafted), 1),
               "tokens_per_s": spec.tokens_per_s,
               "baseline_tokens_per_s": base.tokens_per_s,
               "identical": spec.token_ids == base.token_ids}
        rows.append(row)
        print(f"\n[{lang}] {sentence}\n  detected: {code}   drafter: {desc}\n"
              f"  -> {row['translation']}\n"
              f"  tau {row['tau']:.2f}   mean gamma {row['mean_gamma']:.2f}   "
              f"{row['tokens_per_s']:.1f} tok/s speculative vs "
              f"{row['baseline_tokens_per_s']:.1f} tok/s autoregressive "
              f"({row['tokens_per_s'] / max(row['baseline_tokens_per_s'], 1e-9):.2f}x)   "
              f"identical to greedy: {'yes' if row['identical'] else 'NO'}", file=out)
    if quick:
        del model, router  # one model in memory at a time
        rows.append(_other_model(out, max_new_tokens))
    same = all(r["identical"] for r in rows)
    print(f"\nall outputs identical to greedy decoding: {'yes' if same else 'NO'}", file=out)
    return rows


def _other_model(out, max_new_tokens: int) -> dict:
    """SmolLM2 with n-gram lookup on the German sentence, against its own greedy decoding."""
    import jaxspec

    model = jaxspec.load("smollm2-135m-instruct", dtype="bfloat16")
    p = prompt("German", SENTENCES["German"])
    base = jaxspec.generate(model, [p], max_new_tokens=max_new_tokens, stop="\n")
    spec = make_router(model, "smollm2-135m-instruct").generate(
        [p], sources=[SENTENCES["German"]], gamma="auto", max_new_tokens=max_new_tokens,
        stop="\n", remember=False)
    row = {"language": "German (smollm2-135m-instruct)", "drafter": spec.drafters[0],
           "identical": spec.token_ids == base.token_ids}
    print(f"\n[smollm2-135m-instruct, German] drafter: {spec.drafters[0]}\n"
          f"  -> {spec.texts[0].strip()}\n  identical to greedy: "
          f"{'yes' if row['identical'] else 'NO'}", file=out)
    return row
