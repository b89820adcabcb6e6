#!/usr/bin/env bash
# Every GPU test and benchmark of weave, on a machine with an NVIDIA GPU, ending in one table:
#   1. the cuda-labelled tests (op table in every dtype, tensor-core attention, reductions,
#      norms; NCCL at world size 1 and MPI at 2 ranks sharing the GPU), side by side on the GPU
#      (each one's output kept in $LOG_DIR/test-NAME.log when LOG_DIR is set);
#   2. bench_gpu_kernels against bench/kernels/torch_gpu_kernels.py (PyTorch 2.x on the same GPU),
#      alternating, medians: each kernel as a fraction of the copy bandwidth, SDPA's ratio;
#   3. the GPT step (examples/gpt --device cuda) against bench/training/gpt_torch.py --device cuda,
#      alternating, medians of the per-step times after the first three steps: the 12-layer,
#      d 768, T 1024, vocab 32768 model in bf16 autocast and in float32 (TF32 matrix products on
#      both sides, then full float32 on both), and the 4-layer d 256 model; then (section llama)
#      a ~1B Llama (16 layers, d 2048, 32 query / 8 key-value heads, SwiGLU 5632, T 2048, B 4,
#      vocab 32768, bf16) on plain and on packed windows (PyTorch: SDPA with enable_gqa, and
#      FlexAttention with a document block mask), each against PyTorch eager and, for
#      information, torch.compile; and (section graph) weave's eager step against its step
#      captured as one CUDA graph (--cuda-graph), with their losses, for both models.
#   4. compute-sanitizer memcheck of the cuda suites; 5. examples/gpt --device cuda at 1 rank
#      (NCCL) and 2 ranks (MPI) against the CPU run's held-out loss ($HELDOUT_REFERENCE);
#   6. the host cost of small ops (bench_op_overhead against bench/kernels/torch_op_overhead.py,
#      [4, 64] tensors, --device cuda): what a call costs the host, launches included.
#   bash scripts/gpu-check.sh [runs=3] [steps=12]
#        [what=all|tests,kernels,overhead,gpt,llama,graph,heldout,sanitize,profile]
# Programs come from $WEAVE_BIN (default: build/tests, build/bench, build/examples, then PATH);
# the text from $WEAVE_DATA (default /usr/share/games/fortunes). PyTorch runs as $TORCH_PYTHON
# (default python3) without weave's LD_LIBRARY_PATH (the bundle's libraries are weave's, not
# its); every other variable is the same for both sides.
set -uo pipefail
cd "$(dirname "$0")/.."
# Images that pin OpenBLAS to older kernels set these; neither side may run with them.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
# Ranks share the machine's GPU (and its cores); root runs Open MPI only when told to.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
runs=${1:-3}
steps=${2:-12}
what=${3:-all}
data=${WEAVE_DATA:-/usr/share/games/fortunes}
python=${TORCH_PYTHON:-python3}
for d in ${WEAVE_BIN:-} build/tests build/bench build/examples; do
  [ -d "$d" ] && PATH="$(cd "$d" && pwd):$PATH"
done
torch() { env -u LD_LIBRARY_PATH "$python" "$@"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
table=()
# Sections: "all" (every one but profile) or a comma-separated list.
want() { [ "$what" = all ] || [[ ",$what," == *,$1,* ]]; }
status=0

if want tests; then
  echo "== cuda tests"
  # The suites are independent and share the GPU, so they run side by side; each one's output
  # goes to its own file, read back once all have ended.
  logs=$(mktemp -d)
  names=()
  run_test() {  # name, command...
    local name=$1; shift
    names+=("$name")
    ( start=$SECONDS; timeout "${TEST_TIMEOUT_S:-300}" "$@" >"$logs/$name.out" 2>&1
      echo "$? $((SECONDS - start))" >"$logs/$name.rc" ) &
  }
  run_test cuda_op_table weave_cuda_tests --test-suite=cuda --require-cuda
  run_test cuda_kernels weave_cuda_tests --test-suite=cuda_kernels --require-cuda
  run_test activation_checkpoint weave_cuda_tests --test-suite=activation_checkpoint
  run_test cuda_graph weave_cuda_tests --test-suite=cuda_graph --require-cuda
  run_test nccl_collectives_np1 mpirun --oversubscribe -np 1 weave_mpi_cuda_tests --test-suite=cuda_collectives \
    --require-cuda --backend=nccl
  run_test mpi_cuda_collectives_np2 mpirun --oversubscribe -np 2 weave_mpi_cuda_tests --test-suite=cuda_collectives \
    --require-cuda
  run_test nccl_parallel_np1 mpirun --oversubscribe -np 1 weave_mpi_cuda_tests --test-suite=cuda_parallel \
    --require-cuda --backend=nccl
  run_test mpi_cuda_parallel_np2 mpirun --oversubscribe -np 2 weave_mpi_cuda_tests --test-suite=cuda_parallel \
    --require-cuda
  wait
  for name in "${names[@]}"; do
    read -r rc secs <"$logs/$name.rc"
    verdict=passed
    [ "$rc" -eq 77 ] && verdict=skipped
    [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && { verdict="FAILED (rc $rc)"; status=1; tail -60 "$logs/$name.out"; }
    [ -n "${LOG_DIR:-}" ] && cp "$logs/$name.out" "$LOG_DIR/test-$name.log"
    echo "test $name: $verdict ($secs s)"
    table+=("test|$name|$verdict")
  done
  rm -rf "$logs"
fi

if want kernels; then
  echo "== kernels (weave, then PyTorch, alternating $runs times)"
  declare -A w_us t_us w_frac t_frac
  names=()
  for ((i = 1; i <= runs; ++i)); do
    while read -r line; do
      echo "run $i weave $line"
      n=$(sed 's/.*kernel=\([^ ]*\).*/\1/' <<<"$line"); u=$(sed 's/.* us=\([^ ]*\).*/\1/' <<<"$line")
      f=$(grep -o 'copy_fraction=[0-9.]*' <<<"$line" | cut -d= -f2)
      [ $i -eq 1 ] && names+=("$n")
      w_us[$n]="${w_us[$n]:-} $u"; w_frac[$n]="${w_frac[$n]:-} ${f:-0}"
    done < <(bench_gpu_kernels --trials 5 | grep '^kernel=')
    while read -r line; do
      echo "run $i torch $line"
      n=$(sed 's/.*kernel=\([^ ]*\).*/\1/' <<<"$line"); u=$(sed 's/.* us=\([^ ]*\).*/\1/' <<<"$line")
      f=$(grep -o 'copy_fraction=[0-9.]*' <<<"$line" | cut -d= -f2)
      t_us[$n]="${t_us[$n]:-} $u"; t_frac[$n]="${t_frac[$n]:-} ${f:-0}"
    done < <(torch bench/kernels/torch_gpu_kernels.py --trials 5 | grep '^kernel=')
  done
  for n in "${names[@]}"; do
    wu=$(median ${w_us[$n]}); tu=$(median ${t_us[$n]:-0})
    wf=$(median ${w_frac[$n]}); tf=$(median ${t_frac[$n]:-0})
    table+=("kernel|$n|weave ${wu} us (copy fraction $wf), torch ${tu} us ($tf), weave/torch $(ratio "$wu" "$tu")")
  done
fi

if want overhead; then
  echo "== host cost of small ops on the GPU (weave, then PyTorch, alternating $runs times)"
  declare -A w_op t_op
  ops=()
  for ((i = 1; i <= runs; ++i)); do
    while read -r line; do
      echo "run $i weave $line"
      n=$(sed 's/.*op=\([^ ]*\).*/\1/' <<<"$line"); u=$(sed 's/.* us=\([^ ]*\).*/\1/' <<<"$line")
      [ $i -eq 1 ] && ops+=("$n")
      w_op[$n]="${w_op[$n]:-} $u"
    done < <(bench_op_overhead --device cuda --calls 500 | grep '^op=')
    while read -r line; do
      echo "run $i torch $line"
      n=$(sed 's/.*op=\([^ ]*\).*/\1/' <<<"$line"); u=$(sed 's/.* us=\([^ ]*\).*/\1/' <<<"$line")
      t_op[$n]="${t_op[$n]:-} $u"
    done < <(torch bench/kernels/torch_op_overhead.py --device cuda --calls 500 | grep '^op=')
  done
  for n in "${ops[@]}"; do
    wu=$(median ${w_op[$n]}); tu=$(median ${t_op[$n]:-0})
    table+=("overhead|$n|weave ${wu} us, torch ${tu} us a call, weave/torch $(ratio "$wu" "$tu")")
  done
fi

# The step sections' models and helpers (gpt, llama, graph).
big=(--layers 12 --dim 768 --heads 12 --context 1024 --batch 8 --vocab 32768)
small=(--layers 4 --dim 256 --heads 4 --context 128 --batch 8 --vocab 1024)
step_ms() {  # tokens per step, then the program's output: median step time after 3 steps
  awk -v tok="$1" '/^step [0-9]+\/[0-9]+ loss/ {
    split($2, s, "/"); r = 0
    for (i = 1; i < NF; ++i) if ($i == "tokens/s") r = $(i + 1)
    if (s[1] > 3 && r > 0) print 1000 * tok / r }' |
    sort -g | awk '{v[NR]=$1} END {print (NR%2) ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'
}
# label, tokens, then model flags; $WEAVE_EXTRA and $TORCH_EXTRA go to one side only
gpt_case() {
  local label=$1 tokens=$2; shift 2
  local common=("$@" --steps "$steps" --log-every 1 --eval-every 1000000 --eval-windows 8 --data "$data")
  local ws=() ts=() wm=() tm=() wl tl
  for ((i = 1; i <= runs; ++i)); do
    out=$(gpt --device cuda --samples 0 "${common[@]}" ${WEAVE_EXTRA:-} 2>&1) || { echo "$out" | tail -20; status=1; }
    ws+=("$(step_ms "$tokens" <<<"$out")"); wm+=("$(grep -o 'memory on rank 0: [0-9.]*' <<<"$out" | awk '{print $5}')")
    wl=$(grep -o 'heldout_loss=[0-9.]*' <<<"$out" | cut -d= -f2)
    out=$(torch bench/training/gpt_torch.py --device cuda "${common[@]}" ${TORCH_EXTRA:-} 2>&1) || { echo "$out" | tail -20; status=1; }
    ts+=("$(step_ms "$tokens" <<<"$out")"); tm+=("$(grep -o 'peak_memory_mb=[0-9.]*' <<<"$out" | cut -d= -f2)")
    tl=$(grep -o 'heldout_loss=[0-9.]*' <<<"$out" | cut -d= -f2)
    echo "run $i $label: weave ${ws[-1]} ms ${wm[-1]} MB heldout $wl; torch ${ts[-1]} ms ${tm[-1]} MB heldout $tl"
  done
  local w t
  w=$(median "${ws[@]}"); t=$(median "${ts[@]}")
  table+=("gpt|$label|weave $w ms, torch $t ms, ratio $(ratio "$w" "$t"); peak MB weave $(median "${wm[@]}") torch $(median "${tm[@]}")")
}
if want gpt; then
  echo "== GPT step (weave, then PyTorch, alternating $runs times)"
  gpt_case "12L d768 T1024 B8 V32768 bf16" $((8 * 1024)) "${big[@]}" --autocast bf16
  gpt_case "12L d768 T1024 B8 V32768 fp32 TF32" $((8 * 1024)) "${big[@]}" --matmul-precision high
  gpt_case "12L d768 T1024 B8 V32768 fp32" $((8 * 1024)) "${big[@]}" --matmul-precision highest
  gpt_case "4L d256 T128 B8 V1024 fp32" $((8 * 128)) "${small[@]}"
fi

llama=(--arch llama --layers 16 --dim 2048 --heads 32 --kv-heads 8 --ffn 5632 --context 2048
       --batch 4 --vocab 32768 --autocast bf16)
if want llama; then
  echo "== ~1B Llama step, bf16 (weave, then PyTorch, alternating $runs times)"
  gpt_case "llama 1B T2048 B4 plain" $((4 * 2048)) "${llama[@]}"
  gpt_case "llama 1B T2048 B4 packed" $((4 * 2048)) "${llama[@]}" --pack
  TORCH_EXTRA=--compile gpt_case "llama plain vs compile" $((4 * 2048)) "${llama[@]}"
  TORCH_EXTRA=--compile gpt_case "llama packed vs compile" $((4 * 2048)) "${llama[@]}" --pack
  TORCH_EXTRA=--compile gpt_case "gpt2 bf16 vs compile" $((8 * 1024)) "${big[@]}" --autocast bf16
fi

if want graph; then
  # The same program eager and with --cuda-graph, alternating; the per-step losses must agree.
  echo "== weave eager against its captured step (--cuda-graph), alternating $runs times"
  graph_case() {  # label, tokens, then model flags
    local label=$1 tokens=$2; shift 2
    local common=(--device cuda --samples 0 "$@" --steps "$steps" --log-every 1
                  --eval-every 1000000 --eval-windows 8 --data "$data")
    local es=() gs=() el gl
    for ((i = 1; i <= runs; ++i)); do
      out=$(gpt "${common[@]}" 2>&1) || { echo "$out" | tail -20; status=1; }
      es+=("$(step_ms "$tokens" <<<"$out")"); el=$(grep -o 'loss [0-9.]*' <<<"$out" | tr '\n' ' ')
      out=$(gpt "${common[@]}" --cuda-graph 2>&1) || { echo "$out" | tail -20; status=1; }
      gs+=("$(step_ms "$tokens" <<<"$out")"); gl=$(grep -o 'loss [0-9.]*' <<<"$out" | tr '\n' ' ')
      [ "$el" = "$gl" ] || { echo "losses differ: eager $el / graph $gl"; status=1; }
      echo "run $i $label: eager ${es[-1]} ms, graph ${gs[-1]} ms"
    done
    local e g
    e=$(median "${es[@]}"); g=$(median "${gs[@]}")
    table+=("graph|$label|eager $e ms, graph $g ms, graph/eager $(ratio "$g" "$e"); losses $([ "$el" = "$gl" ] && echo equal || echo DIFFER)")
  }
  graph_case "gpt2 12L d768 bf16" $((8 * 1024)) "${big[@]}" --autocast bf16
  graph_case "llama 1B T2048 B4 plain" $((4 * 2048)) "${llama[@]}"
  graph_case "gpt 4L d256 fp32" $((8 * 128)) "${small[@]}"
fi

if want sanitize; then
  echo "== compute-sanitizer memcheck of the cuda suites"
  for suite in cuda cuda_kernels cuda_graph; do
    out=$(timeout "${SANITIZE_TIMEOUT_S:-600}" compute-sanitizer --tool memcheck --error-exitcode 9 \
      weave_cuda_tests --test-suite=$suite --require-cuda 2>&1); rc=$?
    summary=$(grep -o 'ERROR SUMMARY: [0-9]* error' <<<"$out" | tail -1)
    [ $rc -ne 0 ] && { echo "$out" | tail -30; status=1; }
    echo "memcheck $suite: rc=$rc ${summary:-no summary}"
    table+=("memcheck|$suite|rc=$rc ${summary:-no summary}")
  done
fi

if want heldout; then
  # The example trains the same small model on the GPU at 1 rank (NCCL) and at 2 ranks sharing
  # the GPU (MPI); $HELDOUT_REFERENCE is the CPU run's held-out loss (same flags, --device cpu).
  echo "== examples/gpt --device cuda: held-out loss against the CPU run"
  small_run=(--layers 2 --dim 64 --heads 4 --context 64 --batch 8 --steps 200 --eval-every 1000000
             --eval-windows 32 --log-every 50 --samples 0 --data "$data")
  for mode in "1 nccl" "2 mpi"; do
    set -- $mode
    out=$(mpirun --oversubscribe -np "$1" gpt --device cuda --backend "$2" "${small_run[@]}" 2>&1) ||
      { echo "$out" | tail -20; status=1; }
    held=$(grep -o 'heldout_loss=[0-9.]*' <<<"$out" | cut -d= -f2)
    echo "gpt cuda np$1 $2: heldout_loss=$held (CPU: ${HELDOUT_REFERENCE:-unknown})"
    table+=("heldout|np$1 $2|gpu $held cpu ${HELDOUT_REFERENCE:-unknown}")
  done
fi

if [[ ",$what," == *,profile,* ]]; then
  # Per-kernel GPU time of two steps of the first model in bf16 (Nsight Compute, one metric).
  echo "== ncu: per-kernel time of the GPT step"
  timeout "${PROFILE_TIMEOUT_S:-180}" ncu --metrics gpu__time_duration.sum --print-summary per-kernel \
    --csv gpt --device cuda --samples 0 --layers 12 --dim 768 --heads 12 --context 1024 --batch 8 \
    --vocab 32768 --autocast bf16 --steps 2 --log-every 1 --eval-every 1000000 --eval-windows 8 \
    --data "$data" >"${PROFILE_CSV:-gpt_profile.csv}" 2>&1
  echo "ncu rc=$? -> ${PROFILE_CSV:-gpt_profile.csv}"
fi

echo "== gpu-check summary ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
printf '%s\n' "${table[@]}" | awk -F'|' '{ printf "%-9s %-32s %s\n", $1, $2, $3 }'
exit $status
