"""As heads_data_curve.py (docs/results/heads_data.md), on the first 6,581 rows of the first de
archive plus the second archive (less prompts of the held-out rows): one point of the data
curve at ~2x (both archives extracted into runs/ first).
`python docs/results/heads_data_curve2.py` (2026-12-07)."""
import json, time
import jax, jax.numpy as jnp, numpy as np, yaml
import jaxspec
from jaxspec import sharding
from jaxspec.config import load_yaml
from jaxspec.drafters import hidden
from jaxspec.training import data, distill, drafter_init, heads, recipe, trainer

cfg = load_yaml("configs/deen_gemma3_eagle.yaml", ["train.finetune.steps=600"])
target = jaxspec.load("gemma3-270m", dtype="bfloat16")
V, pad, eos = target.config.vocab_size, target.config.pad_token_id, target.config.eos_token_ids
spec = hidden.hidden_spec("eagle", target.config, 4)
s = recipe.stage_settings(cfg, "finetune")
old = recipe.distilled(cfg)
ex = data.distilled_examples(old)
tokens, mask = heads.example_rows(ex, s.seq_len, pad)
feats = heads.target_features(target, tokens, recipe.features_dir(cfg), heads.row_lengths(mask))
n_train = 6581
held = {r["prompt"] for r in old[n_train:]}
new = [r for r in distill.read_distilled("runs/deen_gemma3_eagle_2/distill") if r["prompt"] not in held]
ex2 = data.distilled_examples(new)
t2, m2 = heads.example_rows(ex2, s.seq_len, pad)
f2 = heads.target_features(target, t2, "runs/deen_gemma3_eagle_2/features", heads.row_lengths(m2))
T = np.concatenate([tokens[:n_train], t2]); M = np.concatenate([mask[:n_train], m2])
F = np.concatenate([np.asarray(feats[:n_train]), np.asarray(f2)])
allex = ex[:n_train] + ex2
print("rows", len(T), "response tokens", sum(sum(k) for _, k in allex), "new dropped", 7170 - len(new), flush=True)
b = yaml.safe_load(open("configs/bench/deen_dev.yaml"))
qs = [json.loads(l)["turns"][0] for l in open(b["questions"])][:40]
prompts = [b["template"].format(prompt=q) for q in qs]
res = jaxspec.generate(target, prompts, max_new_tokens=64, stop="\n")
dev = [(target.tokenizer.encode(p) + r, [0] * len(target.tokenizer.encode(p)) + [1] * len(r))
       for p, r in zip(prompts, res.token_ids)]
dtok, dmask = heads.example_rows(dev, s.seq_len, pad)
dfeat = heads.target_features(target, dtok, "runs/heads_curve/devfeats", heads.row_lengths(dmask))
t0 = time.time()
vocab_ids = drafter_init.frequent_vocab([[t for t, m in zip(i, k) if m] for i, k in allex], 8192, V, always=eos)
shared = spec.shared(target.params, vocab_ids)
head = jax.device_get(hidden.head_params("eagle", target.config, 4, jax.random.key(0), target.params))
mesh = sharding.make_mesh(*s.mesh)
head = trainer.host_params(trainer.train(
    s, target.config, head, data.Batches(T, M, s.batch_size, s.seed, features=F),
    "runs/heads_curve/double", mesh=mesh, loss=heads.head_loss(spec, trainer.head_index(vocab_ids, V), 1.0, s.bf16, 1),
    frozen=shared, param_shardings=jax.tree.map(lambda _: sharding.replicated(mesh), head)))
params = {"shared": shared, "head": head, "vocab_ids": jnp.asarray(vocab_ids)}
row = {"train_s": round(time.time() - t0)}
for name, (f, t, m) in {"heldout": (feats[n_train:], tokens[n_train:], mask[n_train:]),
                        "dev1-40": (dfeat, dtok, dmask)}.items():
    h, c = heads.agreement(spec, params, np.asarray(f), t, m, 4)
    row[name] = [round(float(x), 3) for x in h / np.maximum(c, 1)]
print(len(T), row, flush=True)
