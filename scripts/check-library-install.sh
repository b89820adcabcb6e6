#!/usr/bin/env bash
# The README's library-only route, as written there (its "## Build time" block), from an empty
# build folder into a scratch prefix; then the installed package builds and runs the consumer
# (scripts/check-install.sh). Only the folder names change: build -> a scratch folder,
# /opt/weave -> a scratch prefix.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
block=$(awk '/^## Build time/ {q = 1} q && /^```sh/ {b = 1; next} b && /^```/ {exit} b' README.md)
[ "$(printf '%s\n' "$block" | grep -c '^cmake')" -eq 3 ] ||
  { echo "README's Build time block: expected three cmake lines, found:"; echo "$block"; exit 1; } >&2
while IFS= read -r line; do
  line=${line%%#*}
  [ -n "${line// /}" ] || continue
  line=$(printf '%s' "$line" | sed -e "s| build | $work/build |g" -e "s| build\$| $work/build|" \
    -e "s|/opt/weave|$work/prefix|g")
  echo "\$ $line"
  bash -c "$line"
done <<<"$block"
test -f "$work/prefix/include/weave/weave.h"
ls "$work"/prefix/lib*/libweave.* >/dev/null
test -x "$work/prefix/bin/weave-run"
bash scripts/check-install.sh "$work/build"
echo "library-only install: built, installed and consumed"
