"""llama.cpp (through llama-cpp-python, the optional extra `llamacpp`) on the target's own GGUF:
plain greedy decoding and its prompt-lookup speculation, answering as the other bench rows do."""

from __future__ import annotations

import os
import time

from jaxspec.errors import UserError

INSTALL = ("llama.cpp rows need llama-cpp-python, built from source: bash install.sh "
           "--llamacpp (a C++ compiler and cmake; ~20 minutes on 2 cores)")


def missing() -> str | None:
    """Why the llama.cpp rows cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return INSTALL
    return None


class LlamaCppRunner:
    """One question at a time, greedy, on as many threads as this process may use; `lookup`
    adds llama.cpp's prompt-lookup drafts (n-grams up to 3, 10 tokens a step)."""

    def __init__(self, target_name: str, lookup: bool, chat: bool, stop):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from jaxspec.loading import resolve

        path = resolve(target_name)
        if path.suffix != ".gguf":
            raise UserError(f"llama.cpp rows need a GGUF target; {target_name!r} is {path}")
        if chat:
            raise UserError("llama.cpp rows run completions, not chat templates")
        draft = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=10) if lookup else None
        self.llm = Llama(model_path=str(path), n_threads=len(os.sched_getaffinity(0)),
                         n_ctx=1024, seed=0, verbose=False, draft_model=draft)
        self.stop = [stop] if isinstance(stop, str) else None

    def __call__(self, prompt: str, max_new_tokens: int, seed: int):
        t0 = time.perf_counter()
        out = self.llm.create_completion(prompt, max_tokens=max_new_tokens, temperature=0.0,
                                         stop=self.stop, seed=seed)
        wall = time.perf_counter() - t0
        n = out["usage"]["completion_tokens"]
        return out["choices"][0]["text"], n, wall, [1] * n, 0.0
