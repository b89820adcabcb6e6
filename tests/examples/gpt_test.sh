#!/usr/bin/env bash
# gpt_test.sh GPT MPIRUN...: a short GPT run on the fortunes text at 2 ranks under ddp, fsdp (also
# stopped and resumed) and tp (with and without sequence parallelism), at 4 ranks hybrid and
# HSDP 2 x 2 (also to ddp's at 4), and stopped then resumed from its checkpoint, with activation
# checkpointing (ddp, and tp with
# sequence parallelism), with context parallelism (ring and all-to-all; with data parallelism at
# 4 ranks), with experts spread over ranks (with data parallelism at 4 ranks), and composed at 4
# ranks (fsdp x tensor, fsdp x context, context x experts, tensor x experts; fsdp x experts at 2)
# and at 8 (data x tensor x context; pipeline x tensor x data; fsdp x tensor x context with
# experts), with fsdp stages of a pipeline at 4, with two pipeline stages at 2 ranks (stopped and resumed), must each end
# at the held-out loss of one process on the same global batch (float32: within 1e-3 relative);
# with activation checkpointing, at the same run's without it, to the last printed digit.
# Ranks started with different flags are refused, and --data /proc at once. Exits 77 (skipped) without the fortunes
# package.
set -u
gpt=$1
shift
mpirun=("$@")
[ -d /usr/share/games/fortunes ] || { echo "skipped: no /usr/share/games/fortunes"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(--layers 2 --dim 64 --heads 4 --context 32 --batch 8 --steps 30 --warmup 5
      --eval-every 10 --eval-windows 16 --samples 2)
source "$(dirname "$0")/heldout_check.sh"
reference=$("$gpt" "${args[@]}" | held)
[ -n "$reference" ] || { echo "FAIL: one process printed no heldout_loss"; exit 1; }
echo "one process: heldout_loss=$reference"
tolerance=$(awk -v b="$reference" 'BEGIN { print 1e-3 * b }')  # float32: 1e-3 relative
check_run "ddp np2" 2 --strategy ddp
ddp=$last_heldout
check_run "tp np2" 2 --strategy tp
tp=$last_heldout
check_run "tp np2 without sequence parallelism" 2 --strategy tp --no-sequence-parallel
check_repeats "ddp np2 with activation checkpointing" "$ddp" 2 --strategy ddp \
  --checkpoint-activations
check_repeats "tp np2 with activation checkpointing" "$tp" 2 --strategy tp --checkpoint-activations
check_run "fsdp np2 (ZeRO-3)" 2 --strategy fsdp
check_repeats "fsdp np2 with activation checkpointing" "$last_heldout" 2 --strategy fsdp \
  --checkpoint-activations
"${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --strategy fsdp --checkpoint "$work/fsdp" --stop-at 15 \
  | grep -q "stopped at step 15" || { echo "FAIL: the fsdp run did not stop at step 15"; status=1; }
check_run "fsdp np2 stopped at 15, resumed from its sharded checkpoint" 2 --strategy fsdp \
  --checkpoint "$work/fsdp" --resume
check_run "hybrid np4 (2 x 2)" 4 --strategy hybrid --tp 2
# HSDP (parallel::data_parallel from the mesh's replicate axis): 2 replicas of 2-rank shard
# groups end at DDP's held-out loss over the same 4 ranks (and one process's).
check_run "ddp np4" 4 --strategy ddp
ddp4=$last_heldout
check_run "hsdp 2 x 2 np4" 4 --strategy fsdp --replicate 2
if [ -z "$ddp4" ] || ! awk -v a="$last_heldout" -v b="$ddp4" \
     'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-3 * b) }'; then
  echo "FAIL: hsdp 2 x 2: heldout_loss='$last_heldout', ddp np4's '$ddp4'"
  status=1
fi
"${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --strategy tp --checkpoint "$work/ckpt" --stop-at 15 \
  | grep -q "stopped at step 15" || { echo "FAIL: the run did not stop at step 15"; status=1; }
resumed=$("${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --strategy tp --checkpoint "$work/ckpt" --resume)
echo "$resumed" | grep -q "resumed at step 15" || { echo "FAIL: no resume from step 15"; status=1; }
check "tp np2 stopped at 15, resumed" "$(echo "$resumed" | held)"
echo "$resumed" | grep -q "^samples:" || { echo "FAIL: no samples"; status=1; }
# Context parallelism: each sequence split over 2 ranks (zig-zag parts), ring and all-to-all
# attention, alone and with data parallelism.
check_run "context-parallel np2 (ring)" 2 --context-parallel 2
check_run "context-parallel np2 (all-to-all)" 2 --context-parallel 2 --cp-mode all-to-all
check_run "context-parallel 2 x data 2 np4" 4 --context-parallel 2
# The axes composed: each wrapper reads where every parameter lives.
check_run "fsdp 2 x tensor 2 np4" 4 --strategy fsdp --tp 2
check_run "fsdp 2 x context 2 np4" 4 --strategy fsdp --context-parallel 2
check_run "data 2 x tensor 2 x context 2 np8" 8 --tp 2 --context-parallel 2
# Pipelines: two stages of one block each (1F1B over 4 micro-batches), stopped and resumed from
# their sharded checkpoint; each stage tensor parallel and under DDP at 8 ranks.
"${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --pipeline 2 --checkpoint "$work/pipeline" --stop-at 15 \
  | grep -q "stopped at step 15" || { echo "FAIL: the pipeline run did not stop at 15"; status=1; }
check_run "pipeline 2 np2 stopped at 15, resumed" 2 --pipeline 2 --checkpoint "$work/pipeline" \
  --resume
check_run "pipeline 2 x tensor 2 x data 2 np8" 8 --pipeline 2 --tp 2
check_run "fsdp 2 x pipeline 2 np4" 4 --strategy fsdp --pipeline 2
# Mixture of experts: the dense layer on one process is the reference; experts spread over 2
# ranks, and over 2 ranks with data parallelism across 2 such pairs.
reference=$("$gpt" "${args[@]}" --experts 4 | held)
echo "one process, 4 experts: heldout_loss=$reference"
tolerance=$(awk -v b="$reference" 'BEGIN { print 1e-3 * b }')
check_run "experts 4, expert-parallel 2, np2" 2 --experts 4 --expert-parallel 2
check_run "experts 4, expert-parallel 2 x data 2, np4" 4 --experts 4 --expert-parallel 2
check_run "experts 4 on 2 data-parallel ranks" 2 --experts 4
check_run "context 2 x experts 2 (data 2) np4" 4 --context-parallel 2 --experts 4 \
  --expert-parallel 2
check_run "tensor 2 x experts 2 (data 2) np4" 4 --tp 2 --experts 4 --expert-parallel 2
check_run "fsdp 2 x experts 2 np2" 2 --strategy fsdp --experts 4 --expert-parallel 2
check_run "fsdp 2 x tensor 2 x context 2, experts over 4, np8" 8 --strategy fsdp --tp 2 \
  --context-parallel 2 --experts 4 --expert-parallel 4
# Balanced by a selection bias (no auxiliary loss): the loads are counted over every data rank.
reference=$("$gpt" "${args[@]}" --experts 4 --expert-bias 0.01 | held)
echo "one process, 4 experts, selection bias: heldout_loss=$reference"
tolerance=$(awk -v b="$reference" 'BEGIN { print 1e-3 * b }')
check_run "experts 4 by a selection bias, expert-parallel 2 x data 2, np4" 4 --experts 4 \
  --expert-parallel 2 --expert-bias 0.01
# Ranks started with different flags (--lr on one): every rank raises, none trains, and the job's
# one report (dist::exit_with_error) gives each rank's message once.
out=$("${mpirun[@]}" -np 1 "$gpt" "${args[@]}" --lr 1e-3 : -np 1 "$gpt" "${args[@]}" --lr 2e-3 2>&1)
if [ "$(grep -c "^\[weave\] rank [01]: \[gpt\] the ranks were started with different flags" <<<"$out")" != 2 ] ||
   grep -q "heldout_loss=" <<<"$out"; then
  echo "FAIL: ranks with different flags were not refused: $out"
  status=1
else
  echo "ok: ranks with different flags refused"
fi
# A folder that is not text (the kernel's /proc, whose pseudo-files read forever or hold binary
# data): a clear error, at once.
code=0
out=$(timeout 60 "$gpt" --data /proc --steps 1 2>&1) || code=$?
if [ $code -eq 0 ] || [ $code -eq 124 ] || ! grep -q "\[gpt\].*hint: --data a folder of text" <<<"$out"; then
  echo "FAIL: --data /proc ended with status $code: $out"
  status=1
else
  echo "ok: --data /proc refused: $(tail -1 <<<"$out")"
fi
[ $status -eq 0 ] && echo "PASS: every strategy equals one process"
exit $status
