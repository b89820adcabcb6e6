#!/usr/bin/env bash
# examples/gpt at 2 ranks with --log: the metrics file holds a record per logged step and per
# evaluation, every line one JSON object of the documented fields, and weave-plot draws it as a
# PNG, also beside a spaced copy of itself in one plot, and refuses a file that is not JSON.
# Exit 77 (skipped) without gnuplot or jq.
# usage: metrics_plot_test.sh WEAVE_PLOT GPT MPIRUN...
set -euo pipefail
weave_plot=$1 gpt=$2
shift 2
for tool in gnuplot jq; do  # weave-plot's two (scripts/install-deps.sh installs both)
  command -v $tool >/dev/null || { echo "no $tool: skipped"; exit 77; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$@" -np 2 "$gpt" --layers 1 --dim 32 --heads 2 --context 32 --steps 30 --log-every 10 \
  --eval-every 10 --eval-windows 8 --samples 0 --log "$work/metrics.jsonl" > "$work/out.txt" 2>&1 ||
  { cat "$work/out.txt"; echo "FAIL: the run failed"; exit 1; }
cat "$work/metrics.jsonl"
train=$(grep -c '"kind":"train"' "$work/metrics.jsonl")
evals=$(grep -c '"kind":"eval"' "$work/metrics.jsonl")
[ "$train" -eq 3 ] || { echo "FAIL: $train training records, expected 3 (steps 10, 20, 30)"; exit 1; }
[ "$evals" -eq 3 ] || { echo "FAIL: $evals evaluation records, expected 3"; exit 1; }
for field in step loss lr tokens_per_s grad_norm peak_mb elapsed_s eta_s; do
  [ "$(grep '"kind":"train"' "$work/metrics.jsonl" | grep -c "\"$field\":")" -eq 3 ] ||
    { echo "FAIL: a training record lacks $field"; exit 1; }
done
# Every line is one object: braces balance and nothing trails it.
bad=$(grep -cvE '^\{"[a-z_]+":[^{}]*\}$' "$work/metrics.jsonl" || true)
[ "$bad" -eq 0 ] || { echo "FAIL: $bad lines are not one flat JSON object"; exit 1; }
grep -q "step 30/30 loss [0-9.]* lr" "$work/out.txt" || { echo "FAIL: no progress line"; exit 1; }
"$weave_plot" "$work/metrics.jsonl" -o "$work/curves.png" --title "gpt, 2 ranks"
[ "$(head -c 8 "$work/curves.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] ||
  { echo "FAIL: weave-plot wrote no PNG"; exit 1; }
[ "$(stat -c %s "$work/curves.png")" -gt 10000 ] || { echo "FAIL: the PNG is nearly empty"; exit 1; }
# Any JSON Lines, spaced as people and other tools write it, and two runs in one plot.
sed 's/":/": /g; s/,"/, "/g' "$work/metrics.jsonl" > "$work/spaced.jsonl"
"$weave_plot" "$work/metrics.jsonl" "$work/spaced.jsonl" -o "$work/two.png" --label compact \
  --label spaced
[ "$(head -c 8 "$work/two.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] ||
  { echo "FAIL: weave-plot drew no PNG of two files"; exit 1; }
echo 'not json' > "$work/bad.jsonl"
if "$weave_plot" "$work/bad.jsonl" -o "$work/bad.png" 2> "$work/bad.txt" ||
   ! grep -q "is not JSON Lines" "$work/bad.txt"; then
  echo "FAIL: a file that is not JSON Lines was not refused"; exit 1
fi
echo "PASS: metrics file and plot"
