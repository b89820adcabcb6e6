#!/usr/bin/env bash
# examples/gpt --reproducible: GPT-2 and Llama (grouped-query attention) trained 20 AdamW steps
# with clipping on one global batch of 12 windows in micro-batches of 2, at 1, 2, 3 and 4 ranks
# (the micro-batches dealt unevenly at 4): every run writes the same model.safetensors, byte for
# byte, and logs the same losses and gradient norms to the last bit; ZeRO-1 at 1-4 ranks, FSDP at
# 1-4 ranks and HSDP 2 x 2 write DDP's bytes. Then weave-run at 4 ranks, the last rank killed after step 10,
# relaunched at 3 (a host gone): the resumed run ends with the same bytes as the uninterrupted
# one. Without --reproducible, 1 and 2 ranks differ (the check can tell).
# usage: gpt_reproducible_test.sh GPT WEAVE_RUN MPIRUN...
set -euo pipefail
gpt=$1 weave_run=$2
shift 2
mpirun=("$@")
[ -d /usr/share/games/fortunes ] || { echo "no /usr/share/games/fortunes"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
base=(--layers 2 --dim 64 --heads 4 --context 32 --batch 12 --steps 20 --warmup 5
      --eval-every 100000 --log-every 1 --samples 0 --eval-windows 16)
args=("${base[@]}" --microbatch 2)
# The logged values that must agree: every step's loss and gradient norm, as JSON doubles.
trained() { grep -o '"grad_norm":[^,]*\|"loss":[^,]*' "$1"; }
# DDP and ZeRO-1 (the gradients averaged in the optimizer's step, each rank's AdamW a slice of the
# flattened parameters) at 1-4 ranks, each against DDP at 1 rank.
for arch in gpt llama; do
  extra=()
  [ "$arch" = llama ] && extra=(--arch llama --kv-heads 2)
  for n in 1 2 3 4; do
    for strategy in ddp zero; do
      run=$arch$n$strategy
      "${mpirun[@]}" -np $n "$gpt" "${args[@]}" "${extra[@]}" --reproducible --strategy $strategy \
        --export "$work/$run.safetensors" --log "$work/$run.jsonl" > "$work/out" 2>&1 ||
        { cat "$work/out"; fail "$arch: $strategy at $n ranks"; }
      cmp "$work/${arch}1ddp.safetensors" "$work/$run.safetensors" ||
        fail "$arch: $strategy at $n ranks wrote other weights than ddp at 1 rank"
      diff <(trained "$work/${arch}1ddp.jsonl") <(trained "$work/$run.jsonl") ||
        fail "$arch: $strategy at $n ranks logged other losses than ddp at 1 rank"
      echo "$arch, $strategy at $n ranks: the same bytes and losses as ddp at 1 rank"
    done
  done
done
# FSDP at 1-4 ranks and HSDP 2 x 2, in micro-batches of 1 window (fsdp gathers every unit for
# each micro-batch: every rank runs as many), against DDP at 1 rank on the same micro-batches.
one=("${base[@]}" --microbatch 1)
"${mpirun[@]}" -np 1 "$gpt" "${one[@]}" --reproducible \
  --export "$work/ddp_mb1.safetensors" > /dev/null 2>&1 || fail "ddp with micro-batches of 1"
for layout in "1" "2" "3" "4" "4 --replicate 2"; do
  read -r n replicate <<< "$layout"
  "${mpirun[@]}" -np $n "$gpt" "${one[@]}" --strategy fsdp $replicate \
    --reproducible --export "$work/fsdp.safetensors" > "$work/out" 2>&1 ||
    { cat "$work/out"; fail "fsdp at $layout ranks"; }
  cmp "$work/ddp_mb1.safetensors" "$work/fsdp.safetensors" ||
    fail "fsdp at $layout ranks wrote other weights than ddp at 1 rank"
  echo "fsdp, $layout ranks: the same bytes as ddp at 1 rank"
done
# The plain mode at 1 and 2 ranks: the same run up to rounding, not to the bit.
for n in 1 2; do
  "${mpirun[@]}" -np $n "$gpt" "${args[@]}" --export "$work/plain$n.safetensors" > /dev/null 2>&1
done
if cmp -s "$work/plain1.safetensors" "$work/plain2.safetensors"; then
  fail "the plain mode matched to the bit: the comparison cannot tell modes apart"
fi
# weave-run: 4 slots, then 3 (a host gone after the kill).
cat > "$work/hosts.sh" <<HOSTS
#!/bin/sh
if [ -e "$work/asked" ]; then echo localhost:3; else touch "$work/asked"; echo localhost:4; fi
HOSTS
chmod +x "$work/hosts.sh"
"$weave_run" --mpirun "${mpirun[0]}" --np 4 --min-np 3 --host-discovery-script "$work/hosts.sh" \
  --max-restarts 2 --retry-wait 0 "${mpirun[@]:1}" -- \
  "$gpt" "${args[@]}" --reproducible --checkpoint "$work/ckpt" --checkpoint-every 5 --resume \
  --kill-at 10 --export "$work/shrunk.safetensors" > "$work/run.log" 2>&1 ||
  { cat "$work/run.log"; fail "weave-run"; }
grep -q "attempt 2 of 3: 3 ranks" "$work/run.log" || { cat "$work/run.log"; fail "not relaunched at 3 ranks"; }
grep -q "resumed at step 10" "$work/run.log" || { cat "$work/run.log"; fail "did not resume at step 10"; }
cmp "$work/gpt1ddp.safetensors" "$work/shrunk.safetensors" ||
  fail "killed at 4 ranks and resumed at 3: other weights than the uninterrupted run"
# A resume with another micro-batch size or thread count would part from the run: refused.
"${mpirun[@]}" -np 2 "$gpt" "${args[@]}" --reproducible --checkpoint "$work/ck2" \
  --checkpoint-every 5 --stop-at 5 > /dev/null 2>&1 || fail "the run to resume"
for other in "--microbatch 4" "--microbatch 2 --threads 2"; do
  # shellcheck disable=SC2086
  if "${mpirun[@]}" -np 2 "$gpt" "${base[@]}" --reproducible --checkpoint "$work/ck2" --resume \
    $other > "$work/out" 2>&1; then
    fail "resumed with $other"
  fi
  grep -q "had 2 rows\|compute threads" "$work/out" ||
    { cat "$work/out"; fail "resumed with $other: no error naming it"; }
  echo "resume with $other: refused"
done
echo "PASS: reproducible at 1-4 ranks and across a shrinking restart"
