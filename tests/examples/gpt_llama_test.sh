#!/usr/bin/env bash
# gpt_llama_test.sh GPT MPIRUN...: examples/gpt --arch llama (grouped-query attention with 2
# key/value heads for 4 query heads) on windows packed with several fortunes (--pack: each a
# document, positions and attention restarting at each), at 2 ranks under ddp, fsdp, ddp with
# activation checkpointing, tensor parallelism (the key/value heads split, and with 1 key/value
# head replicated) and context parallelism (ring and all-to-all), and at 4 ranks fsdp x tensor
# and data x context, two pipeline stages (positions and document ids reaching both) at 2 and
# with tensor parallelism at 4; with 4 experts in every block, spread over 2 ranks, and at 4
# ranks data x experts and tensor x experts, must end at one process's held-out loss (float32:
# within 1e-3 relative); unpacked, the same for ddp, fsdp and checkpointing. Activation
# checkpointing repeats the same run's held-out loss without it to the last printed digit (ddp
# packed or not; tp, ring context, pipeline and experts, where models::Llama's
# set_recompute_blocks does it). --pack or
# --kv-heads without --arch llama are refused with a message. Exits 77 (skipped) without the
# fortunes package.
set -u
gpt=$1
shift
mpirun=("$@")
[ -d /usr/share/games/fortunes ] || { echo "skipped: no /usr/share/games/fortunes"; exit 77; }
base=(--arch llama --layers 2 --dim 64 --heads 4 --context 32 --batch 8 --steps 30 --warmup 5
      --eval-every 10 --eval-windows 16 --samples 2)
source "$(dirname "$0")/heldout_check.sh"
one_process() {  # the reference: one process's held-out loss with args, and that it sampled
  local out
  out=$("$gpt" "${args[@]}")
  reference=$(held <<<"$out")
  [ -n "$reference" ] || { echo "FAIL: one process (${args[*]}) printed no heldout_loss"; exit 1; }
  grep -q "^samples:" <<<"$out" || { echo "FAIL: one process (${args[*]}) sampled nothing"; status=1; }
  echo "one process ($*): heldout_loss=$reference"
  tolerance=$(awk -v b="$reference" 'BEGIN { print 1e-3 * b }')  # float32: 1e-3 relative
}
# Unpacked: the data axis (ddp, fsdp) and activation checkpointing.
args=("${base[@]}" --kv-heads 2)
one_process "kv-heads 2, unpacked"
check_run "ddp np2 unpacked" 2 --strategy ddp
ddp=$last_heldout
check_run "fsdp np2 unpacked" 2 --strategy fsdp
check_repeats "ddp np2 with activation checkpointing unpacked" "$ddp" 2 --strategy ddp \
  --checkpoint-activations
# Packed: every axis Llama splits, alone and composed at 4 ranks.
args=("${base[@]}" --kv-heads 2 --pack)
one_process "kv-heads 2, packed"
check_run "ddp np2 --pack" 2 --strategy ddp
ddp=$last_heldout
check_run "fsdp np2 --pack" 2 --strategy fsdp
check_repeats "ddp np2 with activation checkpointing --pack" "$ddp" 2 --strategy ddp \
  --checkpoint-activations
check_run "tp np2 --pack (key/value heads split)" 2 --strategy tp
check_repeats "tp np2 with activation checkpointing --pack (the library model's)" \
  "$last_heldout" 2 --strategy tp --checkpoint-activations
check_run "context-parallel np2 (ring) --pack" 2 --context-parallel 2
check_repeats "context-parallel np2 (ring) with activation checkpointing --pack" \
  "$last_heldout" 2 --context-parallel 2 --checkpoint-activations
check_run "context-parallel np2 (all-to-all) --pack" 2 --context-parallel 2 --cp-mode all-to-all
check_run "fsdp 2 x tensor 2 np4 --pack" 4 --strategy fsdp --tp 2
check_run "data 2 x context 2 np4 --pack" 4 --context-parallel 2
check_run "pipeline 2 np2 --pack (side inputs to every stage)" 2 --pipeline 2
check_repeats "pipeline 2 np2 with activation checkpointing --pack" "$last_heldout" 2 \
  --pipeline 2 --checkpoint-activations
check_run "pipeline 2 x tensor 2 np4 --pack" 4 --pipeline 2 --tp 2
# Every block's MLP a mixture of 4 experts: spread over 2 ranks, alone and with 2 data-parallel
# copies (data 2 x experts 2) or 2 tensor-parallel ranks beside them.
args=("${base[@]}" --kv-heads 2 --pack --experts 4)
one_process "kv-heads 2, packed, 4 experts"
check_run "experts 4, expert-parallel 2, np2 --pack" 2 --expert-parallel 2
check_repeats "experts 4, expert-parallel 2, np2 with activation checkpointing --pack" \
  "$last_heldout" 2 --expert-parallel 2 --checkpoint-activations
check_run "data 2 x experts 2 np4 --pack" 4 --expert-parallel 2
check_run "tensor 2 x experts 2 (data 2) np4 --pack" 4 --tp 2 --expert-parallel 2
# One key/value head for 4 query heads: replicated over the tensor-parallel ranks.
args=("${base[@]}" --kv-heads 1 --pack)
one_process "kv-heads 1, packed"
check_run "tp np2 --pack (one key/value head, replicated)" 2 --strategy tp
refused() {  # name, expected message, then the flags
  local name=$1 message=$2
  shift 2
  if "$gpt" "$@" 2>&1 | grep -q -- "$message"; then
    echo "ok: $name refused"
  else
    echo "FAIL: $name was not refused with '$message'"
    status=1
  fi
}
refused "--pack without llama" "pack needs --arch llama" --pack --layers 1 --dim 32 --heads 2
refused "--kv-heads without llama" "kv-heads 2 needs --arch llama" --kv-heads 2 --layers 1 \
  --dim 32 --heads 2
[ $status -eq 0 ] && echo "PASS: llama equals one process on every axis it takes"
exit $status
