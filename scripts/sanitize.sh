#!/usr/bin/env bash
# The sanitizer job (clang): an AddressSanitizer + UndefinedBehaviorSanitizer build runs the unit
# suites (leak detection on), the MPI suites at 2 ranks (leak detection off: Open MPI's
# own allocations outlive MPI_Finalize) and the fuzzers (scripts/fuzz.sh); a ThreadSanitizer
# build runs the communication-queue suites (async collectives, isend, the guard, the one-
# thread-per-group check), the data-parallel wrappers (DDP, ZeRO, decentralized, the failure
# paths, FSDP's realignment), the pipeline schedules and the sharded checkpoints at 2 ranks. Any
# report fails the job.
#   scripts/sanitize.sh [fuzz seconds per target = 60]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh  # clang, libomp, the sanitizer runtimes
fuzz_seconds=${1:-60}
jobs=$(nproc)
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl_vader_single_copy_mechanism=none WEAVE_TIMEOUT_S=120
mpirun="mpirun --oversubscribe --bind-to none"
configure() {  # build dir, sanitizers, extra cmake args...
  local dir=$1 sanitizers=$2
  shift 2
  CC=clang CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="-O1 -gline-tables-only" \
    -DWEAVE_SANITIZE="$sanitizers" -DWEAVE_BUILD_TESTS=ON -DWEAVE_BUILD_EXAMPLES=OFF \
    -DWEAVE_BUILD_BENCH=OFF -DWEAVE_UNITY_BUILD=OFF "$@" >/dev/null
}

echo "== ASan + UBSan build"
# Every source compiled alone (no unity batches): a source that relies on a batch-mate's includes
# fails here. The library at -O1; the test programs' code, instrumented alike, at -O0 (half its compile).
configure build-sanitize address,undefined -DWEAVE_FUZZ=ON -DWEAVE_TEST_COMPILE_OPTIONS=-O0
build() {  # build dir, targets...: quiet unless it fails
  local dir=$1
  shift
  cmake --build "$dir" -j"$jobs" --target "$@" >"$dir.build.log" 2>&1 ||
    { tail -40 "$dir.build.log"; echo "build of $dir failed" >&2; exit 1; }
}
build build-sanitize weave_tests weave_mpi_tests fuzz_idx fuzz_safetensors fuzz_split_pattern
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
echo "== ASan + UBSan: unit suites"
# The tokenizer suite compares with GPT-2's reference encoders (node, as CTest's fixture runs them).
npm_reference="${WEAVE_NPM_REFERENCE:-$HOME/.cache/weave/npm}"
node tests/support/bpe_reference.js "$npm_reference" /usr/share/games/fortunes \
  tests/data/tokenizer_hard_cases.json build-sanitize/bpe_reference.json >/dev/null
node tests/support/hf_tokenizer_reference.js "$npm_reference" /usr/share/games/fortunes \
  weave/data/text tests/data/tokenizer_hard_cases.json build-sanitize/hf_tokenizer_reference.json \
  >/dev/null
export WEAVE_BPE_REFERENCE=$PWD/build-sanitize/bpe_reference.json WEAVE_NPM_REFERENCE=$npm_reference \
  WEAVE_HF_TOKENIZER_REFERENCE=$PWD/build-sanitize/hf_tokenizer_reference.json
ASAN_OPTIONS=detect_leaks=1 build-sanitize/tests/weave_tests --test-suite-exclude='cuda*' \
  --no-version | tail -3
echo "== ASan + UBSan: MPI suites at 2 ranks"
ASAN_OPTIONS=detect_leaks=0 $mpirun -np 2 build-sanitize/tests/weave_mpi_tests \
  --test-suite-exclude='cuda*' | tail -2
echo "== fuzzing"
bash scripts/fuzz.sh "$fuzz_seconds" build-sanitize

echo "== TSan build"
configure build-tsan thread -DWEAVE_TEST_COMPILE_OPTIONS=-O0
build build-tsan weave_mpi_tests
echo "== TSan: communication-queue, data-parallel, pipeline and checkpoint suites at 2 ranks"
# Open MPI and libomp are not instrumented: ignore what they do through intercepted calls, and
# the lock orders TSan infers inside Open MPI (tests/support/tsan.supp); shared memory only (no TCP).
OMPI_MCA_btl=self,vader \
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$PWD/tests/support/tsan.supp" \
  $mpirun -np 2 build-tsan/tests/weave_mpi_tests --test-suite=collectives,guard,ddp,robust,join,model_parallel,pipeline,sharded_checkpoint,exchange,context_parallel,experts,compose | tail -2
echo "== TSan: an FSDP rank whose forward skips a unit (the failure path realigns), 20 runs"
OMPI_MCA_btl=self,vader \
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ignore_noninstrumented_modules=1 suppressions=$PWD/tests/support/tsan.supp" \
  $mpirun -np 2 build-tsan/tests/weave_mpi_tests --test-case='*skips a unit*' | tail -2
echo "sanitizer job: no reports"
