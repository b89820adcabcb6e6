#!/usr/bin/env bash
# lora_test.sh FINETUNE WEAVE_TOKENIZE NPM_DIR MPIRUN...: a new tiny Llama (GPT-2's tokenizer)
# fine-tuned 30 steps on the fortunes corpus, then rank-8 adapters on every projection of it
# (finetune --lora 8) trained 20 steps at 2 ranks: under tp, fsdp, context parallelism and 2
# pipeline stages they end at ddp's loss (float32: 1e-3 relative); the held-out loss (the
# `wisdom` fortunes) falls; --save writes PEFT's files; --merge saves a plain model that
# generates, reloaded by one process, the tokens the merged run generated; a bfloat16 base
# trains too. Exits 77 (skipped) without the fortunes package.
set -u
finetune=$1 tokenize=$2 npm=$3
shift 3
mpirun=("$@")
. "$(dirname "$0")/fortunes_tokens.sh"
"$finetune" --init llama --tokenizer "$gpt2" --model "$work/new" --dim 64 --layers 2 --heads 4 \
  --kv-heads 2 --tokens "$work/fortunes.tokens" --steps 0 >/dev/null || { echo "FAIL: --init"; exit 1; }
"$finetune" --model "$work/new" --tokens "$work/fortunes.tokens" --steps 30 --context 64 \
  --batch 4 --lr 1e-3 --save "$work/llama" >"$work/pretrain.out" 2>&1 ||
  { echo "FAIL: the base's training"; cat "$work/pretrain.out"; exit 1; }
base=(--model "$work/llama" --tokens "$work/fortunes.tokens" --steps 20 --context 64 --batch 4
      --lr 3e-3 --log-every 10 --lora 8 --lora-targets all-linear)
. "$(dirname "$0")/finetune_runs.sh"
run lora_ddp 2 --save "$work/adapters" --heldout /usr/share/games/fortunes/wisdom --separator %
reference=$(final lora_ddp)
before=$(sed -n 's/^heldout_loss_before=//p' "$work/lora_ddp.out")
after=$(sed -n 's/^heldout_loss=//p' "$work/lora_ddp.out")
awk -v a="$after" -v b="$before" 'BEGIN { exit !(a != "" && b != "" && a < b) }' ||
  { echo "FAIL: the held-out loss went from '$before' to '$after'"; status=1; }
echo "lora held-out loss $before -> $after"
grep -q "lora: rank 8 on 14 projections" "$work/lora_ddp.out" ||
  { echo "FAIL: not 14 adapters"; status=1; }
grep -q '"r": 8' "$work/adapters/adapter_config.json" &&
  grep -aq '"base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"' \
    "$work/adapters/adapter_model.safetensors" || { echo "FAIL: no PEFT files"; status=1; }
for case in "lora_tp 2 --strategy tp" "lora_fsdp 2 --strategy fsdp" \
            "lora_context 2 --context-parallel 2" "lora_pipeline 2 --pipeline 2"; do
  read -r name ranks args <<<"$case"
  # shellcheck disable=SC2086
  run "$name" "$ranks" $args
  agrees "$name"
done
run lora_merged 2 --strategy tp --merge --save "$work/merged" --prompt "The meaning of" \
  --temperature 0 --max-new-tokens 8
agrees lora_merged
"$finetune" --model "$work/merged" --tokens "$work/fortunes.tokens" --steps 0 \
  --prompt "The meaning of" --temperature 0 --max-new-tokens 8 >"$work/reload.out" 2>&1 ||
  { echo "FAIL: the merged model does not load"; status=1; }
merged=$(grep '^generated:' "$work/lora_merged.out") reloaded=$(grep '^generated:' "$work/reload.out")
[ -n "$merged" ] && [ "$merged" = "$reloaded" ] ||
  { echo "FAIL: merged run generated '$merged', its export '$reloaded'"; status=1; }
echo "merged $merged"
run lora_bf16 2 --base-dtype bfloat16
tolerance=2e-2 agrees lora_bf16
[ "$status" -eq 0 ] && echo "PASS: adapters train alike on every layout"
exit "$status"
