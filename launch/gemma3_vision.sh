#!/usr/bin/env bash
# Gemma 3 4B (or 12B, 27B), a vision-language target, with language-only drafters on one GPU:
# a check that speculative output equals plain output with an image, the cost model's plan for
# the embedded Gemma 3 270M as drafter, then a benchmark over questions with images.
#
#   launch/gemma3_vision.sh --model DIR --questions FILE [--out DIR] [--image FILE]
#                           [--drafter SPEC] [--gammas "4 auto"]
#
#   --model DIR       a Hugging Face download of google/gemma-3-4b-it (config.json,
#                     *.safetensors, tokenizer files, preprocessor_config.json)
#   --questions FILE  JSONL, one question a line: {"question_id", "category", "turns": [text],
#                     "images": [paths relative to FILE]}
#   --image FILE      the image of the first check (default: the first question's)
#   --out DIR         bench answers and report (default runs/gemma3-vision)
#   --drafter SPEC    default gemma3-270m; also ngram:3, layerskip:LAYERS, a model path
#   --gammas LIST     draft lengths the bench runs (default "4 auto")
#
# The 270M drafter's 262144 ids are the first of the 4B's 262208 (checked through both
# tokenizers); it never sees the image: each is dropped from its text (bench method
# "drafter:gemma3-270m"), as in Gagrani et al. 2024; a second bench gives it "an image" there.
set -euo pipefail
cd "$(dirname "$0")/.."
model="" questions="" image="" out="runs/gemma3-vision" drafter="gemma3-270m" gammas="4 auto"
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift ;;
    --questions) questions="$2"; shift ;;
    --image) image="$2"; shift ;;
    --out) out="$2"; shift ;;
    --drafter) drafter="$2"; shift ;;
    --gammas) gammas="$2"; shift ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$model" ] || [ -z "$questions" ]; then
  echo "give --model DIR and --questions FILE (--help for more)" >&2; exit 2
fi
jaxspec="${JAXSPEC:-.venv/bin/jaxspec}"
if [ -z "$image" ]; then
  image="$(dirname "$questions")/$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["images"][0])' "$questions")"
fi
prompt="<start_of_image>Describe this image in one sentence."
plain="$("$jaxspec" generate --model "$model" --dtype bfloat16 --image "$image" --prompt "$prompt" --max-new-tokens 48)"
spec="$("$jaxspec" generate --model "$model" --dtype bfloat16 --image "$image" --prompt "$prompt" --max-new-tokens 48 --drafter "$drafter" --gamma 4)"
[ "$plain" = "$spec" ] || { echo "speculative output differs from plain output" >&2; exit 1; }
echo "$plain"
"$jaxspec" plan --model "$model" --dtype bfloat16 --drafter "$drafter" --questions "$questions" --gamma-max 6 --limit 8
case "$drafter" in ngram*|layerskip*|lookahead*) method="$drafter" ;; *) method="drafter:$drafter" ;; esac
# shellcheck disable=SC2086
"$jaxspec" bench --target "$model" --dtype bfloat16 --questions "$questions" --out-dir "$out" \
  --methods ar "$method" --gammas $gammas --max-new-tokens 128
# The same with the drafter reading a short text where each image was (the other way).
# shellcheck disable=SC2086
"$jaxspec" bench --target "$model" --dtype bfloat16 --questions "$questions" \
  --out-dir "$out/placeholder" --methods ar "$method" --gammas $gammas --max-new-tokens 128 \
  --image-placeholder "an image"
