"""The drafters shipped inside the package: each loads offline by name, declares its target and
language pair, stays under 25 MB, and decodes exactly what greedy decoding does on sentences of
its language (written here, in no benchmark file); the built wheel carries them."""

import glob
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jaxspec
from jaxspec import loading
from jaxspec.checkpoints import heads as ckpt_heads
from jaxspec.training.data import language_name

MAX_BYTES = 25 * 2**20
SENTENCES = {
    "de": ["Der Bäcker öffnet seinen Laden jeden Tag um sechs Uhr.",
           "Im Winter fahren viele Familien in die Berge zum Skifahren."],
    "fr": ["La bibliothèque municipale ferme ses portes à dix-neuf heures.",
           "Mon voisin cultive des tomates dans son petit jardin."],
    "ja": ["駅の近くに新しいパン屋ができました。", "週末は家族と一緒に公園を散歩します。"],
    "ru": ["Каждое лето мы ездим к бабушке в деревню.", "Этот музей открыт для посетителей до шести вечера."],
    "zh": ["我的朋友下个月要去北京工作。", "这本书讲述了一个小村庄的历史。"],
}
NAMES = {name: lang for shipped in (loading.SHIPPED, loading.SHIPPED_STREAMS)
         for langs in shipped.values() for lang, name in langs.items()}
TEMPLATE = "Translate {lang} to English:{sentence}\nEnglish:"


@pytest.fixture(scope="module")
def gemma3_bf16(gemma3):
    return replace(gemma3, params=jax.tree.map(lambda p: p.astype(jnp.bfloat16), gemma3.params))


@pytest.mark.parametrize("name", sorted(NAMES))
def test_shipped_drafter_is_exact_on_its_language(name, gemma3_bf16):
    lang = NAMES[name]
    path = loading.resolve(name)
    assert sum(f.stat().st_size for f in path.iterdir()) <= MAX_BYTES
    meta = ckpt_heads.read_meta(path)
    assert meta["target"] == "gemma3-270m" and meta["languages"] == [lang, "en"]
    assert meta["stage"] in ("finetune", "align") and meta["tuned_gamma"] >= 1
    drafter = jaxspec.load_drafter(name, target=gemma3_bf16)
    assert drafter.spec.tuned_branch == meta.get("tuned_branch")  # its default n-gram branch
    prompts = [TEMPLATE.format(lang=language_name(lang), sentence=s) for s in SENTENCES[lang]]
    greedy = jaxspec.generate(gemma3_bf16, prompts, max_new_tokens=24, stop="\n")
    spec = jaxspec.speculative_generate(gemma3_bf16, drafter, prompts, gamma=meta["tuned_gamma"],
                                        max_new_tokens=24, stop="\n")
    assert spec.token_ids == greedy.token_ids
    assert spec.acceptance_rate > 0  # it drafted, and some drafts were right


def test_the_wheel_carries_every_shipped_drafter(tmp_path):
    root = Path(loading.__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(root)], check=True, capture_output=True)
    with zipfile.ZipFile(glob.glob(str(tmp_path / "*.whl"))[0]) as z:
        sizes = {i.filename: i.file_size for i in z.infolist()}
    for name in NAMES:
        where = f"jaxspec/weights/{name.removesuffix('-drafter')}/"
        files = {f: n for f, n in sizes.items() if f.startswith(where)}
        assert set(files) == {where + "head.json", where + "weights.npz"}
        assert sum(files.values()) <= MAX_BYTES
