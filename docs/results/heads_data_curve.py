"""Issue 30 point 0, as data grows (docs/results/heads_data.md): de->en EAGLE heads trained one
draft ahead (600 steps, batch 32 rows of 129 tokens, lr 1e-3, bf16 products, from the target's
last layer, seed 0) on the first 25% / 50% / 100% of the 6,581 training rows of
data/distilled/deen_gemma3_eagle.tar.xz (extracted into runs/deen_gemma3_eagle first); teacher-
forced acceptance by position on the 732 held-out distilled rows and on real dev sentences 1-40.
`python docs/results/heads_data_curve.py 0.25 0.5` (2026-12-07)."""
import json, sys, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np, yaml
import jaxspec
from jaxspec import sharding
from jaxspec.config import load_yaml
from jaxspec.drafters import hidden
from jaxspec.drafters.base import Drafter
from jaxspec.training import data, drafter_init, heads, recipe, trainer

cfg = load_yaml("configs/deen_gemma3_eagle.yaml", ["train.finetune.steps=600"])
target = jaxspec.load("gemma3-270m", dtype="bfloat16")
V, pad = target.config.vocab_size, target.config.pad_token_id
eos = target.config.eos_token_ids
spec = hidden.hidden_spec("eagle", target.config, 4)
s = recipe.stage_settings(cfg, "finetune")
examples = data.distilled_examples(recipe.distilled(cfg))
tokens, mask = heads.example_rows(examples, s.seq_len, pad)
feats = heads.target_features(target, tokens, recipe.features_dir(cfg), heads.row_lengths(mask))
n_train = int(len(examples) * 0.9)
assert n_train == 6581, n_train

# dev 1-40: the target's greedy translations, as `jaxspec bench` prompts them
b = yaml.safe_load(open("configs/bench/deen_dev.yaml"))
qs = [json.loads(l)["turns"][0] for l in open(b["questions"])][:40]
prompts = [b["template"].format(prompt=q) for q in qs]
res = jaxspec.generate(target, prompts, max_new_tokens=64, stop="\n")
dev = [(target.tokenizer.encode(p) + r, [0] * len(target.tokenizer.encode(p)) + [1] * len(r))
       for p, r in zip(prompts, res.token_ids)]
dtok, dmask = heads.example_rows(dev, s.seq_len, pad)
dfeat = heads.target_features(target, dtok, "runs/heads_curve/devfeats", heads.row_lengths(dmask))

out_path = Path("runs/heads_curve/curve.json")
out = json.loads(out_path.read_text()) if out_path.exists() else {}
for frac in [float(x) for x in sys.argv[1:]] or [0.25, 0.5, 1.0]:
    n = int(round(n_train * frac))
    if str(n) in out:
        continue
    t0 = time.time()
    vocab_ids = drafter_init.frequent_vocab([[t for t, m in zip(i, k) if m] for i, k in examples[:n]],
                                            8192, V, always=eos)
    shared = spec.shared(target.params, vocab_ids)
    head = jax.device_get(hidden.head_params("eagle", target.config, 4, jax.random.key(0), target.params))
    mesh = sharding.make_mesh(*s.mesh)
    head = trainer.host_params(trainer.train(
        s, target.config, head, data.Batches(tokens[:n], mask[:n], s.batch_size, s.seed, features=feats[:n]),
        f"runs/heads_curve/{n}", mesh=mesh, loss=heads.head_loss(spec, trainer.head_index(vocab_ids, V), 1.0, s.bf16, 1),
        frozen=shared, param_shardings=jax.tree.map(lambda _: sharding.replicated(mesh), head)))
    params = {"shared": shared, "head": head, "vocab_ids": jnp.asarray(vocab_ids)}
    row = {"train_s": round(time.time() - t0)}
    for name, (f, t, m) in {"train1024": (feats[:1024], tokens[:1024], mask[:1024]),
                            "heldout": (feats[n_train:], tokens[n_train:], mask[n_train:]),
                            "dev1-40": (dfeat, dtok, dmask)}.items():
        h, c = heads.agreement(spec, params, np.asarray(f), t, m, 4)
        row[name] = [round(float(x), 3) for x in h / np.maximum(c, 1)]
    print(n, row, flush=True)
    out[str(n)] = row
    out_path.write_text(json.dumps(out))
