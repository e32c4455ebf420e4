"""transformers (PyTorch, in the jaxspec model's precision) on the same weights: plain and
assisted generation."""

from __future__ import annotations

import tempfile
import time


def _hf_model(name: str, jax_model):
    """The transformers model for a jaxspec model, in its precision: its Hugging Face directory
    when it came from one, else an export of its params (a GGUF's dequantised weights: the
    values transformers' own GGUF loader makes, without its ~8 minutes of dequantising Gemma 3
    on 2 cores)."""
    import jax
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jaxspec.checkpoints.hf import export_hf_dir
    from jaxspec.loading import resolve

    path = resolve(name)
    dtype = getattr(torch, str(jax.tree.leaves(jax_model.params)[0].dtype))
    if path.is_dir() and (path / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        params = jax.tree.map(lambda a: np.asarray(a, np.float32), jax_model.params)  # exact
        with tempfile.TemporaryDirectory() as tmp:
            export_hf_dir(params, jax_model.config, tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype)
    return model.eval()


class HFRunner:
    """Runs one question the way `_JaxRunner` does, through transformers."""

    def __init__(self, target_name, target, method, chat, stop):
        import jaxspec
        from jaxspec.decoding import stops
        from jaxspec.decoding.runner import stop_ids

        self.tok = target.tokenizer
        self.target_model = target
        self.model = _hf_model(target_name, target)
        self.assistant = None
        if method.kind == "hf-assisted":
            self.assistant = _hf_model(method.arg, jaxspec.load(method.arg))
        self.method, self.chat = method, chat
        self.stop_ids = list(stop_ids(target, stop))
        self.stop_strings = stops.strings(target, stop)  # those over several tokens: cut below
        self.calls = 0
        self.model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def __call__(self, prompt: str, max_new_tokens: int, seed: int):
        import torch

        from jaxspec.decoding import stops
        from jaxspec.decoding.runner import encode_prompts

        ids = encode_prompts(self.target_model, [prompt], self.chat)[0]
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=self.stop_ids,
                  pad_token_id=self.stop_ids[0])
        if self.method.temperature > 0:
            kw.update(do_sample=True, temperature=self.method.temperature, top_k=0)
        else:
            kw.update(do_sample=False)
        if self.assistant is not None and self.method.gamma == "auto":
            kw.update(assistant_model=self.assistant, num_assistant_tokens_schedule="heuristic")
        elif self.assistant is not None:
            kw.update(assistant_model=self.assistant, num_assistant_tokens=self.method.gamma,
                      num_assistant_tokens_schedule="constant")
        torch.manual_seed(seed)
        self.calls = 0
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), **kw)
        wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        new, text = stops.cut(self.tok, new, self.stop_strings)
        n = len(new)
        # transformers does not expose per-step accept lengths: spread the tokens over the
        # target's forward calls (one per verification), so tau (their mean) is exact.
        steps = max(1, self.calls) if self.assistant is not None else n
        accept = [n // steps + (1 if i < n % steps else 0) for i in range(steps)]
        return text, n, wall, [a for a in accept if a > 0], 0.0
