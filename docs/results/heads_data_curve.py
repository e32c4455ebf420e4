"""Issue 30 point 0, as data grows (docs/results/heads_data.md): de->en EAGLE heads trained one
draft ahead (batch 32 rows of 129 tokens, lr 1e-3, bf16 products, from the target's last layer,
seed 0) on the first 25% / 50% / 100% of the 6,581 training rows of
data/distilled/deen_gemma3_eagle.tar.xz, or (`--second`) on all of them plus the second archive
(less the rows whose prompt is a held-out row's); teacher-forced acceptance by position on the
732 held-out distilled rows and on real dev sentences 1-40. Both archives extracted into runs/
first (docs/training.md).
`python docs/results/heads_data_curve.py [--steps 600] [--second] [fraction ...]` (2026-12-07:
`0.25 0.5`, then `--second`)."""
import argparse, json, time
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
import jaxspec
from jaxspec import sharding
from jaxspec.config import load_yaml
from jaxspec.drafters import hidden
from jaxspec.training import data, distill, drafter_init, heads, recipe, trainer
from heads_dev_acceptance import dev_rows  # beside this file

ap = argparse.ArgumentParser()
ap.add_argument("fractions", nargs="*", type=float, default=[0.25, 0.5, 1.0])
ap.add_argument("--steps", type=int, default=600)
ap.add_argument("--second", action="store_true")
a = ap.parse_args()
cfg = load_yaml("configs/deen_gemma3_eagle.yaml", [f"train.finetune.steps={a.steps}"])
target = jaxspec.load("gemma3-270m", dtype="bfloat16")
V, pad, eos = target.config.vocab_size, target.config.pad_token_id, target.config.eos_token_ids
spec = hidden.hidden_spec("eagle", target.config, 4)
s = recipe.stage_settings(cfg, "finetune")


def rows(records, out_dir):
    ex = data.distilled_examples(records)
    t, m = heads.example_rows(ex, s.seq_len, pad)
    return ex, t, m, heads.target_features(target, t, recipe.features_dir(out_dir),
                                           heads.row_lengths(m))


old = recipe.distilled(cfg)
examples, tokens, mask, feats = rows(old, cfg["distill"]["out_dir"])
n_train = 6581
assert n_train == int(len(examples) * 0.9)
sets = {}  # name -> (examples, tokens, mask, features) trained on
for frac in ([] if a.second else a.fractions):
    n = int(round(n_train * frac))
    sets[str(n)] = (examples[:n], tokens[:n], mask[:n], feats[:n])
if a.second:
    held = {r["prompt"] for r in old[n_train:]}
    out2 = "runs/deen_gemma3_eagle_2/distill"
    new = [r for r in distill.read_distilled(out2) if r["prompt"] not in held]
    ex2, t2, m2, f2 = rows(new, out2)
    sets[f"both-{a.steps}"] = (examples[:n_train] + ex2, np.concatenate([tokens[:n_train], t2]),
                               np.concatenate([mask[:n_train], m2]),
                               np.concatenate([feats[:n_train], f2]))

dtok, dmask, dfeat = dev_rows(target, "deen", 0, 40)

out_path = Path("runs/heads_curve/curve.json")
out = json.loads(out_path.read_text()) if out_path.exists() else {}
for name, (ex, T, M, F) in sets.items():
    if name in out:
        continue
    t0 = time.time()
    vocab_ids = drafter_init.frequent_vocab([[t for t, m in zip(i, k) if m] for i, k in ex],
                                            8192, V, always=eos)
    shared = spec.shared(target.params, vocab_ids)
    head = jax.device_get(hidden.head_params("eagle", target.config, 4, jax.random.key(0),
                                             target.params))
    mesh = sharding.make_mesh(*s.mesh)
    head = trainer.host_params(trainer.train(
        s, target.config, head, data.Batches(T, M, s.batch_size, s.seed, features=F),
        f"runs/heads_curve/{name}", mesh=mesh,
        loss=heads.head_loss(spec, trainer.head_index(vocab_ids, V), 1.0, s.bf16, 1),
        frozen=shared, param_shardings=jax.tree.map(lambda _: sharding.replicated(mesh), head)))
    params = {"shared": shared, "head": head, "vocab_ids": jnp.asarray(vocab_ids)}
    row = {"rows": len(T), "response_tokens": sum(sum(k) for _, k in ex),
           "train_s": round(time.time() - t0)}
    for set_name, (f, t, m) in {"train1024": (feats[:1024], tokens[:1024], mask[:1024]),
                                "heldout": (feats[n_train:], tokens[n_train:], mask[n_train:]),
                                "dev1-40": (dfeat, dtok, dmask)}.items():
        h, c = heads.agreement(spec, params, np.asarray(f), t, m, 4)
        row[set_name] = [round(float(x), 3) for x in h / np.maximum(c, 1)]
    print(name, row, flush=True)
    out[name] = row
    out_path.write_text(json.dumps(out))
