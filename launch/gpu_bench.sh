#!/usr/bin/env bash
# The accelerator benchmark, ready for a short loan of a GPU machine with no network: installs
# what the machine's python3 lacks from wheels prepared here, then runs
# `python -m jaxspec.bench.device` (step costs in float32 / bfloat16 / int8, plain tokens/s by
# batch, the decode loop's cost drafting with an EAGLE head) and writes results.json and
# report.md to OUT. About 3 minutes on an H100; --dry-run runs a tiny model on any machine.
#
#   launch/gpu_bench.sh [--dry-run] [--wheels DIR] [--out DIR]
#
#   --wheels DIR   install DIR/*.whl first (no index, no dependencies) into /tmp/jaxspec-site
#   --out DIR      where the report goes (default: $OUT if set, else runs/device)
#   --dry-run      a tiny model, seconds: checks the script (CI runs it on CPU)
#
# Preparing a loan here (the device tool sends the working tree, at most 64 MiB; the five shipped
# heads alone are 62 MiB, so move the four this benchmark does not read out of the tree first):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
#   then run: launch/gpu_bench.sh --wheels .whl   (carry: [".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run="" wheels="" out="${OUT:-runs/device}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run="--dry-run" ;;
    --wheels) wheels="$2"; shift ;;
    --out) out="$2"; shift ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
  shift
done
python="${PYTHON:-python3}"
if [ -n "$wheels" ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/jaxspec-site "$wheels"/*.whl
  export PYTHONPATH="/tmp/jaxspec-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -c "import jax; print('devices:', jax.devices())"
"$python" -m jaxspec.bench.device --out "$out" $dry_run
