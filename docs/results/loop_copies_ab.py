"""Plain and head (gamma 2) decoding on 12 real de->en sentences, two passes each (docs/results/
roofline.md): `python docs/results/loop_copies_ab.py LABEL bfloat16|int8`, run once per code
version (an older one through PYTHONPATH=<worktree>)."""
import json, time, sys, yaml, jaxspec
tpl = yaml.safe_load(open("configs/bench/deen_dev.yaml"))["template"]
qs = [json.loads(l)["turns"][0].split(":", 1)[1] for l in open("../shared/data/specbench/deen_question.jsonl")][:12]
prompts = [tpl.format(prompt=q) for q in qs]
target = jaxspec.load("gemma3-270m", dtype=sys.argv[2])
eagle = jaxspec.load_drafter("gemma3-270m-deen-drafter", target=target)
plain = lambda: [jaxspec.generate(target, [p], max_new_tokens=64, stop="\n") for p in prompts]
spec = lambda: [jaxspec.speculative_generate(target, eagle, [p], gamma=2, max_new_tokens=64, stop="\n") for p in prompts]
plain(); spec()
res = {}
for name, f in (("plain", plain), ("spec", spec), ("plain", plain), ("spec", spec)):
    t = time.perf_counter(); rs = f(); dt = time.perf_counter() - t
    res.setdefault(name, []).append(round(sum(r.num_new_tokens for r in rs) / dt, 2))
print(sys.argv[1], sys.argv[2], res, flush=True)
