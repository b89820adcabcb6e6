#!/usr/bin/env bash
# train_lm_test.sh TRAIN_LM WEAVE_TOKENIZE NPM_DIR MPIRUN...: the README's trainer on the fortunes
# corpus (GPT-2's tokenizer) at 2 ranks: its loss falls, it saves a sharded checkpoint, and its
# export holds the weights, the config, the generation config and the tokenizer's files.
# Exits 77 (skipped) without the fortunes package.
set -u
train=$1 tokenize=$2 npm=$3
shift 3
mpirun=("$@")
. "$(dirname "$0")/fortunes_tokens.sh"
"${mpirun[@]}" -np 2 "$train" "$work/fortunes.tokens" "$gpt2" "$work/out" 60 >"$work/run.out" 2>&1 ||
  { echo "FAIL: train_lm"; cat "$work/run.out"; exit 1; }
status=0
first=$(grep -m1 -oE "^step 1/60 loss [0-9.]+" "$work/run.out" | awk '{print $4}')
last=$(grep -oE "^step 60/60 loss [0-9.]+" "$work/run.out" | awk '{print $4}')
echo "loss: step 1 $first, step 60 $last"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(a != "" && b != "" && b < 0.8 * a) }' ||
  { echo "FAIL: the loss did not fall by a fifth"; cat "$work/run.out"; status=1; }
grep -q "^total [0-9,]* parameters" "$work/run.out" || { echo "FAIL: no summary"; status=1; }
for f in model.safetensors config.json generation_config.json tokenizer.json \
         tokenizer_config.json special_tokens_map.json; do
  [ -f "$work/out/model/$f" ] || { echo "FAIL: the export lacks $f"; status=1; }
done
[ -f "$work/out/checkpoint/index.json" ] || { echo "FAIL: no checkpoint"; status=1; }
[ $status -eq 0 ] && echo "PASS: train_lm trains, checkpoints and exports"
exit $status
