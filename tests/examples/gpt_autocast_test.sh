#!/usr/bin/env bash
# gpt_autocast_test.sh GPT MPIRUN...: a small GPT trained at 2 ranks (ddp) in float32, under
# bfloat16 autocast, and under float16 autocast with the loss scaler, and at 2 ranks with tensor
# parallelism under bfloat16: each reduced-precision run must end within 0.03 nats of the
# float32 held-out loss; fsdp with its bfloat16 policy within 0.01 of the bfloat16 ddp run.
# Exits 77 (skipped) without the fortunes package.
set -u
gpt=$1
shift
mpirun=("$@")
[ -d /usr/share/games/fortunes ] || { echo "skipped: no /usr/share/games/fortunes"; exit 77; }
args=(--layers 2 --dim 128 --heads 4 --context 64 --batch 16 --steps 150 --warmup 15
      --eval-every 1000 --eval-windows 64 --samples 1 --log-every 50)
source "$(dirname "$0")/heldout_check.sh"
reference=$("${mpirun[@]}" -np 2 "$gpt" "${args[@]}" | held)
[ -n "$reference" ] || { echo "FAIL: the float32 run printed no heldout_loss"; exit 1; }
echo "float32: heldout_loss=$reference"
tolerance=0.03
bf16=$("${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --autocast bf16 | held)
check "ddp np2 bf16" "$bf16"
check "ddp np2 fp16 + GradScaler" "$("${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --autocast fp16 | held)"
check "tp np2 bf16" "$("${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --strategy tp --autocast bf16 | held)"
# FSDP's mixed-precision policy (bfloat16 gathers and compute, float32 shards and reductions):
# within 0.01 of the bfloat16-autocast DDP run.
reference=$bf16 tolerance=0.01
check "fsdp np2 --param-dtype bf16, against ddp bf16" \
  "$("${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --strategy fsdp --param-dtype bf16 | held)"
[ $status -eq 0 ] && echo "PASS: reduced precision within 0.03 nats of float32"
