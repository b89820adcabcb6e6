#!/usr/bin/env bash
# Runs each libFuzzer target for a bounded time, seeded with real files (fuzz/seeds: Fashion-
# MNIST IDX excerpts, a Python-style safetensors file, a weave checkpoint) and the inputs that
# once crashed (fuzz/regressions). Fails on any crash, sanitizer report, leak, timeout or
# out-of-memory; the offending input is left in $out for fuzz/regressions/<target>/.
#   scripts/fuzz.sh [seconds per target = 60] [build dir = build-sanitize]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60} build=${2:-build-sanitize}
out=${FUZZ_OUT:-$build/fuzz-findings}
mkdir -p "$out"
for target in idx safetensors split_pattern; do
  corpus=$(mktemp -d)
  echo "== fuzz_$target for ${seconds}s"
  if ! "$build/fuzz/fuzz_$target" "$corpus" "fuzz/seeds/$target" "fuzz/regressions/$target" \
      -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 \
      -print_final_stats=1 -artifact_prefix="$out/$target-" 2>"$out/$target.log"; then
    tail -40 "$out/$target.log"
    echo "fuzz_$target FAILED; the input is in $out (add it to fuzz/regressions/$target/)" >&2
    exit 1
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$out/$target.log" | tr '\n' ' '
  echo "corpus=$(ls "$corpus" | wc -l)"
  rm -rf "$corpus"
done
