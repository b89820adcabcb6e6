#!/usr/bin/env bash
# Installs a built weave into a scratch prefix, then builds and runs examples/consumer against
# it twice: through CMake's find_package(weave) and through pkg-config. Also checks that the
# package hands no -march flag to its consumers.
#   bash scripts/check-install.sh [build-dir]      (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
prefix=$(mktemp -d)
work=$(mktemp -d)
trap 'rm -rf "$prefix" "$work"' EXIT

cmake --install "$build" --prefix "$prefix" >/dev/null
test -f "$prefix/include/weave/weave.h"
test -f "$prefix/lib/cmake/weave/weaveConfig.cmake"
if find "$prefix/include" -name '*.h' | xargs grep -l '#include "\(tensor\|ops\|autograd\|nn\|optim\|data\|distributed\|kernels\)/' ; then
  echo "installed headers include weave paths without the weave/ prefix" >&2
  exit 1
fi
# Only the public headers: each weave header an installed one includes is installed, and the
# internal ones (kernels, the communication runtime, the flat-buffer layer) are not.
for header in $(find "$prefix/include" -name '*.h'); do
  for included in $(sed -n 's/^#include "\(weave\/[^"]*\)".*/\1/p' "$header"); do
    test -f "$prefix/include/$included" || { echo "$header includes $included, not installed" >&2; exit 1; }
  done
done
for internal in weave/kernels/kernels.h weave/distributed/runtime.h weave/parallel/core/flat_buffer.h \
    weave/parallel/core/readiness.h weave/parallel/core/agree.h weave/parallel/checkpoint/reshard.h; do
  if test -e "$prefix/include/$internal"; then echo "internal header $internal installed" >&2; exit 1; fi
done

echo "== consumer through find_package(weave)"
cmake -S examples/consumer -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
cmake --build "$work/cmake" >/dev/null
if grep -q -- '-march' "$work/cmake/compile_commands.json"; then
  echo "the package leaked -march into the consumer's flags" >&2
  exit 1
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
"$work/cmake/consumer"
mpirun --oversubscribe --bind-to none -np 2 "$work/cmake/consumer" | grep -c "consumer ok" | grep -qx 2
# The installed weave/util/cli.h: a flag out of range is a usage error (status 2), named.
status=0
"$work/cmake/consumer" --steps -1 2> "$work/usage.txt" || status=$?
[ "$status" -eq 2 ] && grep -q "must be above" "$work/usage.txt" ||
  { echo "consumer --steps -1: status $status, $(cat "$work/usage.txt")" >&2; exit 1; }

echo "== consumer through pkg-config"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
# shellcheck disable=SC2046
c++ -Iexamples/consumer examples/consumer/main.cpp -o "$work/consumer-pc" \
  $(pkg-config --cflags weave) $(pkg-config --libs --static weave)
"$work/consumer-pc"

echo "== the forwarding headers of weave/parallel/ and weave/data/ (0.2) still compile, each alone"
for header in "$prefix"/include/weave/parallel/*.h "$prefix"/include/weave/data/{tokenizer,pretokenizer,token_dataset,hf_checkpoint}.h; do
  echo "#include \"${header#"$prefix"/include/}\"" >"$work/forward.cpp"
  # shellcheck disable=SC2046
  c++ -std=c++20 -fsyntax-only "$work/forward.cpp" $(pkg-config --cflags weave)
done
echo "install check: find_package and pkg-config consumers built and ran"
