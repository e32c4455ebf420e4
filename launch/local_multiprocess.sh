#!/usr/bin/env bash
# Run one jaxspec command as N cooperating JAX processes on this machine (CPU), the way a
# multi-host job runs: process i gets
#   distributed.coordinator_address=localhost:PORT distributed.num_processes=N
#   distributed.process_id=i
# as key=value overrides (the recipe's `distributed` section, jaxspec/training/recipe.py), so
# `jax.distributed.initialize` joins them into one job. Waits for all; if one fails, the others
# are stopped and the script exits with its status.
#
#   launch/local_multiprocess.sh [options] [SUBCOMMAND] [--config FILE] [key=value ...]
#
#   SUBCOMMAND              a jaxspec subcommand (default: train)
#   -n, --num-processes N   processes (default 2)
#   --port PORT             coordinator port (default: a free one)
#   --devices-per-process K CPU devices each process sees (default 1)
#   --log-dir DIR           write process i's output to DIR/process_i.log (default: terminal)
#   --dry-run               print the commands, run nothing
#
# Environment: JAXSPEC, the jaxspec command (default `jaxspec`; may hold several words, such as
# "python -m jaxspec.cli"). Example:
#   launch/local_multiprocess.sh -n 2 distill --config configs/tiny.yaml
#   launch/local_multiprocess.sh -n 2 train --config configs/tiny.yaml train.finetune.steps=4
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "local_multiprocess.sh: $*" >&2; exit 2; }

num=2 port="" devices=1 log_dir="" dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n|--num-processes) [ $# -ge 2 ] || die "$1 needs a value"; num=$2; shift 2 ;;
    --port) [ $# -ge 2 ] || die "$1 needs a value"; port=$2; shift 2 ;;
    --devices-per-process) [ $# -ge 2 ] || die "$1 needs a value"; devices=$2; shift 2 ;;
    --log-dir) [ $# -ge 2 ] || die "$1 needs a value"; log_dir=$2; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ "$num" =~ ^[1-9][0-9]*$ ]] || die "--num-processes must be a positive integer, got '$num'"
[[ "$devices" =~ ^[1-9][0-9]*$ ]] || die "--devices-per-process must be a positive integer"

subcommand=train
case "${1:-}" in
  generate|distill|train|bench|report|export|demo) subcommand=$1; shift ;;
esac

if [ -z "$port" ]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])' 2>/dev/null) \
    || port=$((20000 + RANDOM % 20000))
fi
[[ "$port" =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"

read -r -a jaxspec_cmd <<< "${JAXSPEC:-jaxspec}"
xla_flags="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$devices"

if [ "$dry_run" = 1 ]; then
  for ((i = 0; i < num; i++)); do
    cmd=("${jaxspec_cmd[@]}" "$subcommand" "$@"
         "distributed.coordinator_address=localhost:$port" "distributed.num_processes=$num"
         "distributed.process_id=$i")
    printf 'JAX_PLATFORMS=cpu XLA_FLAGS=%q' "$xla_flags"
    printf ' %q' "${cmd[@]}"
    [ -n "$log_dir" ] && printf ' > %q 2>&1' "$log_dir/process_$i.log"
    printf ' &\n'
  done
  echo "wait  # all $num processes; any failure fails the run"
  exit 0
fi

[ -n "$log_dir" ] && mkdir -p "$log_dir"
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap 'stop_all; exit 130' INT TERM

for ((i = 0; i < num; i++)); do
  cmd=("${jaxspec_cmd[@]}" "$subcommand" "$@"
       "distributed.coordinator_address=localhost:$port" "distributed.num_processes=$num"
       "distributed.process_id=$i")
  if [ -n "$log_dir" ]; then
    JAX_PLATFORMS=cpu XLA_FLAGS="$xla_flags" "${cmd[@]}" > "$log_dir/process_$i.log" 2>&1 &
  else
    JAX_PLATFORMS=cpu XLA_FLAGS="$xla_flags" "${cmd[@]}" &
  fi
  pids+=("$!")
done
echo "local_multiprocess.sh: started $num processes of 'jaxspec $subcommand' (coordinator localhost:$port)" >&2

# Wait for the processes as they finish; the first failure stops the rest (they would otherwise
# block on a collective with a dead peer until JAX's timeout). `wait -n -p` needs bash >= 5.1;
# older shells wait in process order.
status=0
fail() {  # fail PROCESS_INDEX STATUS
  echo "local_multiprocess.sh: process $1 (pid ${pids[$1]}) failed with status $2;" \
       "stopping the others" >&2
  [ -n "$log_dir" ] && tail -n 30 "$log_dir/process_$1.log" >&2
  status=$2
  stop_all
  wait || true
}
if (( BASH_VERSINFO[0] > 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] >= 1) )); then
  running=("${pids[@]}")
  while [ ${#running[@]} -gt 0 ]; do
    rc=0
    wait -n -p done_pid "${running[@]}" || rc=$?
    for ((i = 0; i < num; i++)); do [ "${pids[$i]}" = "$done_pid" ] && finished=$i; done
    if [ "$rc" -ne 0 ]; then fail "$finished" "$rc"; break; fi
    still=()
    for pid in "${running[@]}"; do [ "$pid" != "$done_pid" ] && still+=("$pid"); done
    running=("${still[@]}")
  done
else
  for ((i = 0; i < num; i++)); do
    rc=0
    wait "${pids[$i]}" || rc=$?
    if [ "$rc" -ne 0 ]; then fail "$i" "$rc"; break; fi
  done
fi
trap - INT TERM
exit "$status"
