"""The main install runs without torch (a test-only reference): the embedded models' tokenizers
come from the GGUF files through transformers' converter, not its torch-importing GGUF reader."""

import subprocess
import sys
import textwrap

import pytest

from jaxspec.checkpoints import gguf
from jaxspec.loading import resolve

MODELS = ("gemma3-270m", "smollm2-135m-instruct")
TEXTS = ["Guten Morgen!\n\nWie geht's?", "Le train part à huit heures du matin.",
         "明日は雨が降るので、傘を持って行ってください。", "  two spaces,\ttab",
         "Мой брат работает врачом.",
         "这家餐厅的菜非常好吃。<eos><|im_end|>"]

# As if torch were not installed: `import torch` raises ModuleNotFoundError and
# importlib.util.find_spec("torch") answers None (how libraries probe for it).
BLOCK_TORCH = """
import sys
sys.modules["torch"] = None
"""


@pytest.mark.parametrize("name", MODELS)
def test_loading_needs_no_torch(name, tmp_path):
    """Converting (empty cache) and loading again (from the cache), with `import torch` made
    to fail: the tokenizer and the weights both load."""
    code = BLOCK_TORCH + textwrap.dedent(f"""
        import jaxspec
        for _ in range(2):
            m = jaxspec.load({name!r}, dtype="bfloat16")
            assert m.tokenizer("Hello").input_ids, "no tokenizer"
        assert sys.modules["torch"] is None  # nothing imported it after all
        print("ok")
    """)
    env = {"JAXSPEC_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_equals_transformers_gguf_tokenizer(name):
    """The same ids, special tokens and chat template as `AutoTokenizer.from_pretrained(dir,
    gguf_file=...)` (which needs torch: here, in the test environment)."""
    from transformers import AutoTokenizer

    path = resolve(name)
    ours = gguf.load_gguf_tokenizer(path)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(ours) == len(ref)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text
        ids = ref(text).input_ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
            ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert ours.chat_template == ref.chat_template
