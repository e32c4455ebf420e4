"""A vision-language target (Gemma 3 with its SigLIP tower) and language-only drafters.

The tiny target here has a byte tokenizer with Gemma's three image tokens added after it, and
the model drafter is its text model over the byte tokenizer alone: the drafter's vocabulary is a
prefix of the target's, as Gemma 3 270M's 262144 ids are of the vision models' 262208. With
weights of std 0.1 and image embeddings of std 3 the images change what the target writes, and
the text-only drafters are still accepted (tau >= 1.3), so the identity tests can fail.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import VisionConfig
from jaxspec.decoding import image_prompts
from jaxspec.decoding.sampling import Sampling
from jaxspec.images import Preprocess, prepare
from jaxspec.models import transformer, vision
from jaxspec.models.cache import init_cache
from jaxspec.models.params import init_params
from jaxspec.training.data import byte_tokenizer

VC = VisionConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=16,
                  patch_size=4, tokens_per_image=4, image_token_id=261, boi_token_id=259,
                  eoi_token_id=260)
PROMPTS = ["Describe the picture: ", "<start_of_image>What is in it? A"]


def image_tokenizer():
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<start_of_image>", "<end_of_image>", "<image_soft_token>"]})
    return tok


def embeddings(model, rows):
    """Each row's image embeddings [rows, images * M, D], as the decoder prepares them."""
    pix = image_prompts.pixels(model, rows)
    emb = image_prompts.encode(model.vision.params, jnp.asarray(pix), config=model.vision.config)
    return image_prompts.arrange(emb, rows, len(rows))


@pytest.fixture(scope="module")
def target():
    cfg = jaxspec.ModelConfig(
        arch="gemma3", vocab_size=262, hidden_size=32, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=64, max_position=512,
        layer_types=("sliding", "full", "sliding"), sliding_window=8, query_scale=0.3,
        rope_local_theta=100.0, bos_token_id=1)
    params = init_params(cfg, jax.random.key(0), std=0.1)
    tower = vision.Vision(VC, vision.init_params(VC, 32, jax.random.key(1), 3.0), Preprocess(16))
    return jaxspec.Model(cfg, params, image_tokenizer(), "vlm", vision=tower)


@pytest.fixture(scope="module")
def text_drafter(target):
    """The target's text model over the byte tokenizer's 259 ids."""
    p = target.params
    return jaxspec.Model(target.config.replace(vocab_size=259), {**p, "embed": p["embed"][:259]},
                         byte_tokenizer(), "text")


@pytest.fixture(scope="module")
def images():
    rng = np.random.RandomState(0)
    return [rng.randint(0, 256, (20, 24, 3), np.uint8) for _ in range(3)]


@pytest.fixture(scope="module")
def plain(target, images):
    return jaxspec.generate(target, PROMPTS, images=images[:2], max_new_tokens=[24, 17])


def drafters(target, text_drafter):
    return {"model": text_drafter, "layer skip": jaxspec.layer_skip_drafter(target, [1]),
            "n-gram": jaxspec.ngram_drafter()}


def test_images_change_what_the_target_writes(target, images, plain):
    """Other images of the same count run the executables compiled for the first (the image
    encoder's among them: the decoder counts it)."""
    from jaxspec.decoding import runner

    compiles = runner.DECODER.compiles
    other = jaxspec.generate(target, PROMPTS, images=[images[2], images[2]],
                             max_new_tokens=[24, 17])
    assert all(a != b for a, b in zip(plain.token_ids, other.token_ids))
    assert runner.DECODER.compiles == compiles and other.compile_time_s < plain.compile_time_s
    text = jaxspec.generate(target, [PROMPTS[0]], max_new_tokens=24)
    assert text.token_ids[0] != plain.token_ids[0]


@pytest.mark.parametrize("placeholder", [None, "[image]"])
@pytest.mark.parametrize("kind", ["model", "layer skip", "n-gram"])
def test_greedy_identity_with_images(target, text_drafter, images, plain, kind, placeholder):
    """Ragged batch of two rows with different images, and the first row alone."""
    drafter = drafters(target, text_drafter)[kind]
    out = jaxspec.speculative_generate(target, drafter, PROMPTS, images=images[:2], gamma=3,
                                       max_new_tokens=[24, 17], image_placeholder=placeholder)
    assert out.token_ids == plain.token_ids
    assert out.tau >= 1.3
    one = jaxspec.speculative_generate(target, drafter, PROMPTS[:1], images=images[:1],
                                       gamma=3, max_new_tokens=24,
                                       image_placeholder=placeholder)
    assert one.token_ids == plain.token_ids[:1]


def test_tree_drafts_with_images(target, text_drafter, images, plain):
    out = jaxspec.speculative_generate(target, text_drafter, PROMPTS, images=images[:2],
                                       tree=[(0,), (1,), (0, 0), (0, 0, 0)],
                                       max_new_tokens=[24, 17])
    assert out.token_ids == plain.token_ids and out.tau >= 1.3
    look = jaxspec.speculative_generate(target, jaxspec.lookahead_drafter(3, 3, 3), PROMPTS,
                                        images=images[:2], max_new_tokens=[24, 17])
    assert look.token_ids == plain.token_ids  # a drafter with a shape and state of its own


def test_a_batch_where_one_row_has_no_image(target, text_drafter, images):
    prompts = ["Plain text, no picture: A", PROMPTS[1]]
    plain = jaxspec.generate(target, prompts, images=[None, images[1]], max_new_tokens=[20, 17])
    out = jaxspec.speculative_generate(target, text_drafter, prompts, images=[None, images[1]],
                                       gamma=3, max_new_tokens=[20, 17])
    assert out.token_ids == plain.token_ids


def test_prompt_already_expanded_by_the_processor(target, images, plain):
    """Token ids that hold the image tokens (transformers' processor's output) go in as they
    are: the same tokens as the marker expanded here."""
    ids = image_prompts.expand(target, target.tokenizer(PROMPTS[1]).input_ids, 1)
    assert ids.count(VC.image_token_id) == VC.tokens_per_image
    out = jaxspec.generate(target, [ids], images=[images[1]], max_new_tokens=17)
    assert out.token_ids[0] == plain.token_ids[1]


def test_the_drafter_sees_the_text_without_the_image(target):
    """The drafter's view: spans dropped, or each replaced by the placeholder; the generated
    text follows with a fixed shift."""
    from jaxspec.drafters.text_view import TextViewSpec

    nl = target.tokenizer("\n\n", add_special_tokens=False).input_ids
    ids = image_prompts.expand(target, [1, 10, 259, 11, 12], 1)
    assert ids == [1, 10, *nl, 259, 261, 261, 261, 261, 260, *nl, 11, 12]
    tokens = jnp.asarray([ids + [40, 41, 0, 0]])
    for placeholder, text in (((), [1, 10, *nl, *nl, 11, 12]),
                              ((7, 8), [1, 10, *nl, 7, 8, *nl, 11, 12])):
        spec = TextViewSpec(None, (261, 259, 260), placeholder)
        got, n = spec._text(tokens, jnp.asarray([len(ids)]))
        assert int(n[0]) == len(text) and got[0, :len(text)].tolist() == text


def test_vocabulary_prefix_rule(target, text_drafter):
    """Same ids mean the same tokens: a drafter whose tokenizer is the target's first ids is
    accepted and never drafts an id it lacks; another tokenizer, or none to check, is refused."""
    from jaxspec.decoding.sampling import pick
    from jaxspec.drafters.model import same_tokens

    assert same_tokens(target.tokenizer, text_drafter.tokenizer)
    assert not same_tokens(text_drafter.tokenizer, target.tokenizer)
    d = jaxspec.model_drafter(text_drafter, target=target)
    d.spec.validate(d.params, target)
    logits = d.spec._vocab_logits(jnp.zeros((1, 259)), 262)
    _, q = pick(jax.random.key(0), logits, Sampling(temperature=1.0))
    assert q.shape == (1, 262) and float(q[0, 259:].sum()) == 0.0

    class Shuffled:
        def __len__(self):
            return 259

        def convert_ids_to_tokens(self, ids):
            return [f"t{(i * 7) % 259}" for i in ids]

    with pytest.raises(ValueError, match="drafter's tokenizer"):
        jaxspec.speculative_generate(target, dataclasses.replace(text_drafter,
                                                                 tokenizer=Shuffled()),
                                     PROMPTS[:1], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"drafter vocabulary \(259\) does not match"):
        jaxspec.speculative_generate(target, dataclasses.replace(text_drafter, tokenizer=None),
                                     PROMPTS[:1], max_new_tokens=4)


def test_sampling_with_images_has_the_targets_distribution(exact):
    """The first two sampled tokens after an image prompt: the empirical joint of 4 x 2048
    speculative rows against the target's, enumerated from full forwards with the image, within
    the largest distance of 400 exact samplers' draws of as many rows; the joint of a target
    blind to the image lies well outside it."""
    vc = dataclasses.replace(VC, image_token_id=7, boi_token_id=5, eoi_token_id=6)
    cfg = jaxspec.ModelConfig(arch="gemma3", vocab_size=8, hidden_size=32, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                              max_position=32, query_scale=0.3)
    tower = vision.Vision(vc, vision.init_params(vc, 32, jax.random.key(4), 1.0), Preprocess(16))
    target = jaxspec.Model(cfg, init_params(cfg, jax.random.key(20), std=0.15), None, "t",
                           vision=tower)
    drafter = jaxspec.Model(cfg, init_params(cfg, jax.random.key(21), std=0.15), None, "d")
    image = np.random.RandomState(1).randint(0, 256, (16, 16, 3), np.uint8)
    prompt = image_prompts.expand(target, [1, 2, 5, 3, 4], 1)
    emb = jnp.asarray(embeddings(target, [[image]]))
    s = Sampling(temperature=1.0)

    def last(seqs, emb=emb):
        """Processed next-token distributions; a generated 7 is text, not an image token."""
        tok = jnp.asarray(seqs)
        B, S = tok.shape
        text = jnp.arange(S) >= len(prompt)
        blocks = jnp.where(text, -1, transformer.image_blocks(tok, 7))
        x = jnp.where(text[:, None], transformer.embed(target.params, cfg, tok),
                      transformer.with_images(target.params, cfg, tok, jnp.repeat(emb, B, 0), 7))
        logits, _ = transformer.forward(target.params, cfg, tok, jnp.broadcast_to(
            jnp.arange(S), (B, S)), init_cache(cfg, B, S), inputs_BxSxD=x,
            blocks=(blocks, blocks))
        return exact.processed(logits[:, -1], s)

    joint = last([prompt])[0][:, None] * last([prompt + [t] for t in range(8)])
    blank = jnp.zeros_like(emb)  # the negative control: a sampler blind to the image
    blind = last([prompt], blank)[0][:, None] * last([prompt + [t] for t in range(8)], blank)
    rows, counts = 2048, np.zeros((8, 8))
    rng = np.random.RandomState(0)
    null = [0.5 * np.abs(rng.multinomial(4 * rows, joint.ravel()) / (4 * rows)
                         - joint.ravel()).sum() for _ in range(400)]
    bound = max(null)  # about the 99.75th percentile of an exact sampler's distance
    assert 0.5 * np.abs(blind - joint).sum() > bound + 0.02
    for seed in range(4):
        out = jaxspec.speculative_generate(target, drafter, [prompt] * rows,
                                           images=[image] * rows, gamma=2, max_new_tokens=2,
                                           temperature=1.0, seed=seed)
        for t in out.token_ids:
            counts[t[0], t[1]] += 1
    tv = 0.5 * np.abs(counts / counts.sum() - joint).sum()
    assert tv < bound, (tv, bound)


def test_bad_inputs(target, text_drafter, images, tmp_path):
    text_only = dataclasses.replace(target, vision=None)
    with pytest.raises(ValueError, match="text-only model"):
        jaxspec.generate(text_only, PROMPTS[:1], images=images[:1], max_new_tokens=4)
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(ValueError, match="cannot be read as an image"):
        jaxspec.generate(target, PROMPTS[:1], images=[bad], max_new_tokens=4)
    with pytest.raises(ValueError, match="does not exist"):
        jaxspec.generate(target, PROMPTS[:1], images=[tmp_path / "none.png"], max_new_tokens=4)
    with pytest.raises(ValueError, match="1 <start_of_image> markers but 2 images"):
        jaxspec.generate(target, PROMPTS[1:], images=[images[:2]], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 image entries for 1 prompts"):
        jaxspec.generate(target, PROMPTS[:1], images=images[:2], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"must be \[height, width, 3\]"):
        jaxspec.generate(target, PROMPTS[:1], images=[np.zeros((4, 4))], max_new_tokens=4)
    from jaxspec.drafters.hidden import head_params, hidden_drafter

    head = hidden_drafter(target, "medusa", head_params("medusa", target.config, 2,
                                                        jax.random.key(0)), depth=2)
    with pytest.raises(ValueError, match="reads the target's hidden states"):
        jaxspec.speculative_generate(target, head, PROMPTS[:1], images=images[:1], gamma=2,
                                     max_new_tokens=4)


# --- against transformers ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Gemma3ForConditionalGeneration saved as transformers saves it, with a
    tokenizer and its image processor's configuration."""
    torch = pytest.importorskip("torch")
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    torch.manual_seed(0)
    text = dict(vocab_size=262, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=6,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                max_position_embeddings=512)
    vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               image_size=32, patch_size=8, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vis, mm_tokens_per_image=4,
                          boi_token_index=259, eoi_token_index=260, image_token_index=261)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp("gemma3_vlm")
    model.save_pretrained(path)
    image_tokenizer().save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    return path, model


def test_pixels_match_transformers_processor(hf_dir, images):
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = Gemma3ImageProcessorPil.from_pretrained(hf_dir[0])
    pre = Preprocess.from_hf(json.loads((hf_dir[0] / "preprocessor_config.json").read_text()),
                             32)
    pil = Image.fromarray(images[0])
    for im in (pil, images[1], pil.convert("RGBA")):
        want = proc(images=im, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
        np.testing.assert_allclose(prepare([im], pre)[0], want, atol=1e-6)


def test_logits_match_transformers(hf_dir, images):
    """Text, two images (each bidirectional inside, causal across) and text, float32."""
    torch = pytest.importorskip("torch")
    path, ref = hf_dir
    model = jaxspec.load(path, dtype="float32")
    assert model.vision is not None and model.vision.config.tokens_per_image == 4
    ids = [2, 5, 6, 259] + [261] * 4 + [260, 7, 8, 259] + [261] * 4 + [260, 9, 10, 11, 12, 13]
    emb = jnp.asarray(embeddings(model, [images[:2]]))
    tok = jnp.asarray([ids])
    blocks = transformer.image_blocks(tok, 261)
    x = transformer.with_images(model.params, model.config, tok, emb, 261)
    S = len(ids)
    got, _ = transformer.forward(model.params, model.config, tok, jnp.arange(S)[None],
                                 init_cache(model.config, 1, S), inputs_BxSxD=x,
                                 blocks=(blocks, blocks))
    pixels = prepare(images[:2], model.vision.preprocess)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([ids]).eq(261).long(),
                   pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2)).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(got[0]), want, atol=1e-4, rtol=1e-4)


def test_vision_weights_in_the_hub_layout(hf_dir):
    """Checkpoints written by older transformers name the tower vision_tower.vision_model.*:
    both layouts give the same params."""
    from safetensors.numpy import load_file

    from jaxspec.checkpoints import hf

    state = load_file(str(hf_dir[0] / "model.safetensors"))
    vc = hf.vision_config_from_hf(json.loads((hf_dir[0] / "config.json").read_text()))
    old = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v
           for k, v in state.items()}
    a = hf.vision_params_from_hf_state(state.__getitem__, vc)
    b = hf.vision_params_from_hf_state(old.__getitem__, vc)
    assert jax.tree.all(jax.tree.map(np.array_equal, a, b))
    with pytest.raises(ValueError, match="checkpoint has no tensor"):
        hf.vision_params_from_hf_state({}.__getitem__, vc)


def test_cli_and_bench_take_images(hf_dir, images, tmp_path, capsys):
    """`jaxspec generate --image` and a question file whose questions hold images, with the
    n-gram drafter: the same text as plain decoding."""
    from PIL import Image

    from jaxspec import cli
    from jaxspec.bench.specbench import Method, run_bench
    from jaxspec.questions import read_answers

    for i, im in enumerate(images[:2]):
        Image.fromarray(im).save(tmp_path / f"im{i}.png")
    path = str(hf_dir[0])
    args = ["generate", "--model", path, "--prompt", "<start_of_image>Look:",
            "--image", str(tmp_path / "im0.png"), "--max-new-tokens", "8", "--dtype", "float32"]
    cli.main(args)
    plain = capsys.readouterr().out
    cli.main(args + ["--drafter", "ngram", "--gamma", "2", "--image-placeholder", "[img]"])
    assert capsys.readouterr().out == plain
    qs = tmp_path / "vqa.jsonl"
    qs.write_text("".join(json.dumps({"question_id": i, "category": "vqa",
                                      "turns": ["What is this?"], "images": [f"im{i}.png"]})
                          + "\n" for i in range(2)))
    methods = [Method("ar"), Method("ngram", gamma=2)]
    files = run_bench(path, str(qs), methods, str(tmp_path / "out"), max_new_tokens=6,
                      dtype="float32")
    ar, ng = (read_answers(files[m.name]) for m in methods)
    assert [a["choices"][0]["turns"] for a in ar] == [a["choices"][0]["turns"] for a in ng]
    assert len(ar) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 0, "category": "vqa", "turns": ["x"],
                               "images": "im0.png"}) + "\n")
    with pytest.raises(ValueError, match="'images' must be a list"):
        run_bench(path, str(bad), [Method("ar")], str(tmp_path / "out2"), max_new_tokens=2)


def test_launch_script_runs_on_a_tiny_vision_model(hf_dir, images, tmp_path):
    """launch/gemma3_vision.sh end to end (check, plan, bench) with the tiny model and the
    n-gram drafter: what a user with Gemma 3 4B weights runs on a GPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from PIL import Image

    Image.fromarray(images[0]).save(tmp_path / "a.png")
    qs = tmp_path / "q.jsonl"
    qs.write_text(json.dumps({"question_id": 0, "category": "caption", "turns": ["Describe."],
                              "images": ["a.png"]}) + "\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, JAXSPEC=str(Path(sys.executable).parent / "jaxspec"),
               JAXSPEC_CACHE=str(tmp_path / "cache"))
    p = subprocess.run(["bash", str(root / "launch/gemma3_vision.sh"), "--model", str(hf_dir[0]),
                        "--questions", str(qs), "--drafter", "ngram:3", "--gammas", "2",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       env=env, timeout=900, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "step cost by gamma" in p.stdout
    assert len(list((tmp_path / "out").rglob("*.jsonl"))) == 4  # plain, drafter; both ways


def test_auto_gamma_and_a_mesh_with_images(target, text_drafter, images, plain, tmp_path,
                                           monkeypatch):
    """gamma="auto" (its step costs measured for the prefix-vocabulary drafter) and a target
    split over a mesh, image side included: the same tokens."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    out = jaxspec.speculative_generate(target, text_drafter, PROMPTS, images=images[:2],
                                       gamma="auto", gamma_max=3, max_new_tokens=[24, 17])
    assert out.token_ids == plain.token_ids
    from jaxspec.loading import shard
    from jaxspec.sharding import make_mesh

    mesh = make_mesh()
    sharded = shard(target, mesh)
    assert jax.tree.leaves(sharded.vision.params)[0].sharding.mesh == mesh
    out = jaxspec.generate(sharded, PROMPTS, images=images[:2], max_new_tokens=[24, 17])
    assert out.token_ids == plain.token_ids


def test_gemma3_4b_config_and_its_preset():
    """Gemma 3 4B's config.json gives its text side only where it differs from transformers'
    defaults: read with them it is the `random:gemma3-4b` preset's shape (end-of-turn 106
    aside, which the preset leaves out)."""
    from jaxspec.checkpoints import hf
    from jaxspec.models.presets import SHAPES, VISION

    published = {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    got = hf.config_from_hf(published)
    assert got.eos_token_ids == (1, 106)
    assert got.replace(eos_token_ids=(1,)) == jaxspec.ModelConfig.from_dict(SHAPES["gemma3-4b"])
    assert hf.vision_config_from_hf(published) == VISION["gemma3-4b"]
