#!/usr/bin/env bash
# Run one jaxspec command on every worker of a Cloud TPU pod slice (TPU VM), over
#   gcloud compute tpus tpu-vm ssh NAME --zone ZONE [--project PROJECT] --worker=all --command=...
# Each worker installs the checkout it holds at --repo-dir and runs the same command with
# `distributed=auto`: `jax.distributed.initialize()` finds the coordinator, the process count and
# its own index from the TPU metadata, so no addresses are needed.
#
#   launch/tpu_pod.sh --name NAME --zone ZONE [options] [SUBCOMMAND] [--config FILE] [key=value ...]
#
#   --name NAME        the TPU VM (default: $TPU_NAME)
#   --zone ZONE        its zone (default: $ZONE)
#   --project PROJECT  the GCP project (default: $PROJECT, else gcloud's configured one)
#   --config FILE      recipe YAML, relative to --repo-dir on the workers
#   --repo-dir DIR     the jaxspec checkout on every worker (default: ~/jaxspec)
#   --python PYTHON    the workers' Python (default: python3); jaxspec runs as
#                      `PYTHON -m jaxspec.cli`, which needs no script directory on PATH
#   --no-install       skip `PYTHON -m pip install -e . "jax[tpu]"` on the workers
#   --dry-run          print the gcloud command, run nothing
#   SUBCOMMAND         a jaxspec subcommand (default: train); what follows it (key=value
#                      overrides, other jaxspec flags) passes through unchanged.
#
# The checkout must already be on each worker, e.g. once:
#   gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \
#     --command="git clone https://github.com/jaxspec/jaxspec ~/jaxspec"
# Checkpoints are written by all workers together: put train.workdir (and distill.out_dir) on
# storage every worker mounts at the same path (NFS, Filestore, a gcsfuse mount).
# Example:
#   launch/tpu_pod.sh --name my-v5e-32 --zone us-west4-a --config configs/deen_gemma3.yaml \
#     train.workdir=/mnt/shared/deen/train distill.out_dir=/mnt/shared/deen/distill
# Decoding over the whole slice (params, KV cache and rows split over a data x fsdp x tensor
# mesh of every chip; each worker passes the same prompts and prints the same result):
#   launch/tpu_pod.sh --name my-v5e-8 --zone us-west4-a generate --model /mnt/llama-2-7b-hf \
#     --dtype bfloat16 --mesh 1,1,8 --drafter layerskip:16-23 --prompt "Hallo, wie geht's?"
#   launch/tpu_pod.sh --name my-v5e-8 --zone us-west4-a bench --target /mnt/llama-2-7b-hf \
#     --mesh 1,1,8 --dtype bfloat16 --questions question.jsonl --methods ngram
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "tpu_pod.sh: $*" >&2; exit 2; }

name=${TPU_NAME:-} zone=${ZONE:-} project=${PROJECT:-} config="" repo_dir="~/jaxspec"
python=python3 install=1 dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --name) [ $# -ge 2 ] || die "$1 needs a value"; name=$2; shift 2 ;;
    --zone) [ $# -ge 2 ] || die "$1 needs a value"; zone=$2; shift 2 ;;
    --project) [ $# -ge 2 ] || die "$1 needs a value"; project=$2; shift 2 ;;
    --config) [ $# -ge 2 ] || die "$1 needs a value"; config=$2; shift 2 ;;
    --repo-dir) [ $# -ge 2 ] || die "$1 needs a value"; repo_dir=$2; shift 2 ;;
    --python) [ $# -ge 2 ] || die "$1 needs a value"; python=$2; shift 2 ;;
    --no-install) install=0; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ -n "$name" ] || die "give --name (or set TPU_NAME)"
[ -n "$zone" ] || die "give --zone (or set ZONE)"

subcommand=train
case "${1:-}" in
  generate|distill|train|bench|report|export|demo) subcommand=$1; shift ;;
esac

# The command each worker runs, quoted for the worker's shell. The repo dir is left unquoted so
# a leading ~ expands there, not here.
jaxspec_args=("$python" -m jaxspec.cli "$subcommand")
[ -n "$config" ] && jaxspec_args+=(--config "$config")
jaxspec_args+=("$@" distributed=auto)
remote="cd $repo_dir"
[ "$install" = 1 ] && remote+=" && $(printf '%q' "$python") -m pip install -q -e . \"jax[tpu]\""
remote+=" &&$(printf ' %q' "${jaxspec_args[@]}")"

gcloud_args=(gcloud compute tpus tpu-vm ssh "$name" --zone "$zone")
[ -n "$project" ] && gcloud_args+=(--project "$project")
gcloud_args+=(--worker=all "--command=$remote")

if [ "$dry_run" = 1 ]; then  # one line to paste into a shell
  quote() {  # single quotes where needed
    if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then printf '%s' "$1"
    else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
  }
  line=$(quote "${gcloud_args[0]}")
  for arg in "${gcloud_args[@]:1}"; do line+=" $(quote "$arg")"; done
  echo "$line"
  exit 0
fi
command -v gcloud >/dev/null || die "gcloud is not installed (https://cloud.google.com/sdk)"
exec "${gcloud_args[@]}"
