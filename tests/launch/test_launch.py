"""The launch scripts: each `--dry-run` prints the command it would run; the local one also runs
the tiny recipe for real as two cooperating JAX processes (distill, then train)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"


def run(*argv, env=None, timeout=60, check=True, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    p = subprocess.run(["bash", *map(str, argv)], capture_output=True, text=True, env=env,
                       timeout=timeout, cwd=cwd)
    if check:
        assert p.returncode == 0, f"{argv} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return p


# --- TPU pod -------------------------------------------------------------------------------

def test_tpu_pod_dry_run():
    out = run(LAUNCH / "tpu_pod.sh", "--name", "pod-1", "--zone", "us-central2-b", "--project",
              "my-proj", "--config", "configs/tiny.yaml", "--dry-run", "train.lr=1e-4",
              "note=two words").stdout.strip()
    assert len(out.splitlines()) == 1
    argv = shlex.split(out)  # the printed line is valid shell
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod-1"]
    assert argv[argv.index("--zone") + 1] == "us-central2-b"
    assert argv[argv.index("--project") + 1] == "my-proj"
    assert "--worker=all" in argv
    remote = next(a for a in argv if a.startswith("--command="))[len("--command="):]
    assert remote.startswith("cd ~/jaxspec && ")
    assert "pip install" in remote and "-e ." in remote
    steps = [shlex.split(s) for s in remote.split(" && ")]
    cmd = steps[-1]
    assert cmd[:4] == ["python3", "-m", "jaxspec.cli", "train"]
    assert cmd[cmd.index("--config") + 1] == "configs/tiny.yaml"
    assert "train.lr=1e-4" in cmd and "note=two words" in cmd
    assert cmd[-1] == "distributed=auto"  # jax.distributed.initialize() reads the TPU metadata


def test_tpu_pod_env_defaults_subcommand_and_no_install():
    out = run(LAUNCH / "tpu_pod.sh", "--dry-run", "--no-install", "distill", "distill.out_dir=x",
              env={"TPU_NAME": "envpod", "ZONE": "europe-west4-a", "PROJECT": ""}).stdout
    argv = shlex.split(out)
    assert argv[5] == "envpod" and "europe-west4-a" in argv and "--project" not in argv
    remote = next(a for a in argv if a.startswith("--command="))
    assert "pip" not in remote
    assert "jaxspec.cli distill distill.out_dir=x distributed=auto" in remote


def test_tpu_pod_needs_name_and_zone():
    env = {"TPU_NAME": "", "ZONE": ""}
    p = run(LAUNCH / "tpu_pod.sh", "--zone", "z", "--dry-run", env=env, check=False)
    assert p.returncode != 0 and "--name" in p.stderr
    p = run(LAUNCH / "tpu_pod.sh", "--name", "n", "--dry-run", env=env, check=False)
    assert p.returncode != 0 and "--zone" in p.stderr


# --- SLURM ---------------------------------------------------------------------------------

def test_slurm_sbatch_header():
    text = (LAUNCH / "slurm_gpu.sbatch").read_text()
    header = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    opts = dict(ln.split(None, 1)[1].lstrip("-").split("=", 1) for ln in header)
    assert int(opts["nodes"]) >= 2
    assert int(opts["ntasks-per-node"]) >= 1
    assert opts["gpus-per-task"] == "1"  # one task per GPU


def test_slurm_dry_run():
    env = {k: "" for k in ("SLURM_JOB_ID", "JAXSPEC")}
    out = run(LAUNCH / "slurm_gpu.sbatch", "--dry-run", "--config", "configs/tiny.yaml",
              "train.lr=1e-4", env=env).stdout
    lines = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert len(lines) == 1
    argv = shlex.split(lines[0])
    assert argv[0] == "srun" and "jaxspec" in argv
    cmd = argv[argv.index("jaxspec"):]
    assert cmd == ["jaxspec", "train", "--config", "configs/tiny.yaml", "train.lr=1e-4",
                   "distributed=auto"]


def test_slurm_outside_a_job_without_dry_run_refuses():
    p = run(LAUNCH / "slurm_gpu.sbatch", "distill", env={"SLURM_JOB_ID": ""}, check=False)
    assert p.returncode != 0 and "sbatch" in p.stderr


# --- local multi-process -------------------------------------------------------------------

def test_local_dry_run():
    out = run(LAUNCH / "local_multiprocess.sh", "--dry-run", "-n", "3", "--port", "12345",
              "distill", "--config", "configs/tiny.yaml", "distill.out_dir=x",
              env={"JAXSPEC": ""}).stdout
    procs = [shlex.split(ln) for ln in out.splitlines() if "jaxspec" in ln and "=" in ln]
    assert len(procs) == 3
    ids = []
    for argv in procs:
        assert "JAX_PLATFORMS=cpu" in argv and argv[-1] == "&"
        cmd = argv[argv.index("jaxspec"):-1]
        assert cmd[:4] == ["jaxspec", "distill", "--config", "configs/tiny.yaml"]
        assert "distill.out_dir=x" in cmd
        assert "distributed.coordinator_address=localhost:12345" in cmd
        assert "distributed.num_processes=3" in cmd
        ids += [a.split("=")[1] for a in cmd if a.startswith("distributed.process_id=")]
    assert sorted(ids) == ["0", "1", "2"]


def test_local_default_subcommand_is_train():
    out = run(LAUNCH / "local_multiprocess.sh", "--dry-run", "--config", "c.yaml",
              env={"JAXSPEC": ""}).stdout
    procs = [ln for ln in out.splitlines() if "jaxspec" in ln]
    assert len(procs) == 2 and all(" jaxspec train --config c.yaml " in ln for ln in procs)


def test_local_one_failure_fails_the_run(tmp_path):
    """Process 1 fails at once; process 0 would hang: it is stopped and the status propagates."""
    fake = tmp_path / "fake_jaxspec"
    fake.write_text('#!/usr/bin/env bash\n'
                    'case "$*" in *process_id=1*) echo boom >&2; exit 3 ;; esac\n'
                    'sleep 60\n')
    fake.chmod(0o755)
    p = run(LAUNCH / "local_multiprocess.sh", "-n", "2", "--log-dir", tmp_path / "logs", "train",
            env={"JAXSPEC": str(fake)}, timeout=30, check=False)
    assert p.returncode == 3
    assert "process 1" in p.stderr and "boom" in p.stderr


def jaxspec_env() -> dict:
    """The test's own environment's `jaxspec` first on PATH."""
    bin_dir = Path(sys.executable).parent
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env["JAXSPEC"] = "jaxspec" if (bin_dir / "jaxspec").exists() else \
        f"{sys.executable} -m jaxspec.cli"
    return env


def test_local_two_processes_run_the_tiny_recipe(tmp_path):
    """configs/tiny.yaml with its prompts from a small text file (the selfgen sources cost a
    compile each) and no pretraining stage: distill split over 2 processes, then 2 finetuning
    steps as one 2-process job."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    (tmp_path / "prompts.txt").write_text(
        "".join(f"Das ist der kurze Satz Nummer {i}.\n" for i in range(8)))
    cfg["data"] = {"prompts": {"type": "text", "path": str(tmp_path / "prompts.txt")}}
    cfg["train"]["pretrain"]["steps"] = 0  # no data.pretrain: finetuning on the distilled data
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    distilled, workdir = tmp_path / "distill", tmp_path / "train"
    common = ["--config", tmp_path / "tiny.yaml", f"distill.out_dir={distilled}"]
    env = jaxspec_env()

    run(LAUNCH / "local_multiprocess.sh", "-n", "2", "--log-dir", tmp_path / "logs_distill",
        "distill", *common, "distill.temperatures=[0.0]", "distill.block_size=4",
        "distill.max_new_tokens=8", env=env, timeout=600, cwd=tmp_path)
    shards = sorted(distilled.glob("t0-b*.jsonl"))
    assert [s.name for s in shards] == ["t0-b000000.jsonl", "t0-b000001.jsonl"]  # one each
    assert sum(len(s.read_text().splitlines()) for s in shards) == 8

    run(LAUNCH / "local_multiprocess.sh", "-n", "2", "--log-dir", tmp_path / "logs_train",
        "train", *common, f"train.workdir={workdir}", "train.finetune.steps=2", "train.finetune.loss=ce", "train.seq_len=16",
        "train.eval_every=0", "train.save_every=1", env=env, timeout=600, cwd=tmp_path)
    for i in range(2):
        assert "Traceback" not in (tmp_path / "logs_train" / f"process_{i}.log").read_text()
    metrics = [json.loads(ln) for ln in
               (workdir / "finetune" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert sorted(p.name for p in (workdir / "finetune" / "checkpoints").iterdir()
                  if p.name.isdigit()) == ["1", "2"]
    assert (workdir / "drafter" / "jaxspec.json").is_file()
    assert not (workdir / "drafter.tmp").exists()


# --- decoding over a mesh --------------------------------------------------------------------

def test_decode_and_bench_entry_points_dry_run():
    """generate and bench reach every TPU worker / SLURM task with the mesh and distributed=auto,
    and the jaxspec command accepts --mesh."""
    out = run(LAUNCH / "tpu_pod.sh", "--name", "v5e-8", "--zone", "z", "--dry-run", "--no-install",
              "generate", "--model", "/mnt/llama-7b", "--mesh", "1,1,8", "--prompt", "Hallo").stdout
    remote = next(a for a in shlex.split(out) if a.startswith("--command="))
    cmd = shlex.split(remote.split(" && ")[-1])
    assert cmd[3:] == ["generate", "--model", "/mnt/llama-7b", "--mesh", "1,1,8", "--prompt",
                       "Hallo", "distributed=auto"]
    out = run(LAUNCH / "slurm_gpu.sbatch", "--dry-run", "bench", "--target", "/data/llama-7b",
              "--mesh", "1,1,8", env={"SLURM_JOB_ID": "", "JAXSPEC": ""}).stdout
    argv = shlex.split([ln for ln in out.splitlines() if not ln.startswith("#")][0])
    assert argv[argv.index("jaxspec"):] == ["jaxspec", "bench", "--target", "/data/llama-7b",
                                            "--mesh", "1,1,8", "distributed=auto"]
    from jaxspec.cli import parser

    for sub in ("generate", "bench"):
        assert parser().parse_args([sub, "--mesh", "2,1,4"]).mesh == "2,1,4"


# --- GPU benchmark --------------------------------------------------------------------------

def test_gpu_bench_dry_run_writes_its_report(tmp_path):
    """The accelerator benchmark runs end to end on CPU with a tiny model and writes both files:
    every precision has a step cost per size and tokens/s per batch, and the loop its costs."""
    out = tmp_path / "device"
    run(LAUNCH / "gpu_bench.sh", "--dry-run", "--out", out,
        env={"PYTHON": sys.executable}, timeout=600)
    r = json.loads((out / "results.json").read_text())
    assert r["dry_run"] and r["backend"] == "cpu"
    assert set(r["dtypes"]) == {"float32", "bfloat16", "int8"}
    for d in r["dtypes"].values():
        assert set(d["target_ms"]) == {"1", "4"} and all(t > 0 for t in d["target_ms"].values())
        assert set(d["tokens_per_s"]) == {"1", "2"} and all(t > 0
                                                            for t in d["tokens_per_s"].values())
    assert len(r["dtypes"]["bfloat16"]["loop_ms_by_gamma"]) == 3
    assert "| int8 |" in (out / "report.md").read_text()


def test_gpu_bench_report_survives_an_untimeable_loop():
    """A tiny model's loop step can time as zero on a busy machine: the report says so instead of
    dividing by it."""
    from jaxspec.bench.device import report

    d = {"target_ms": {"1": 0.1}, "step_mb": 0.3, "tokens_per_s": {"1": 10.0}}
    r = {"device": "cpu", "backend": "cpu", "jax": "x", "model": "tiny", "seconds": 1.0,
         "dtypes": {"bfloat16": {**d, "loop_ms_by_gamma": [0.0, 0.0]}}}
    assert "too fast to time" in report(r)
    r["dtypes"]["bfloat16"]["loop_ms_by_gamma"] = [2.0, 3.0]
    assert "0: 1.00, 1: 1.50" in report(r)
