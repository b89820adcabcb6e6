#!/usr/bin/env bash
# weave-ckpt on indexes the loader refuses: each must exit 1 with the loader's own message (no
# crash, no "checksums: ok", no C++ internals).
#   ckpt_tool_test.sh WEAVE_CKPT
set -u
weave_ckpt=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0
check() {  # name, index.json text, expected message part
  local name=$1 text=$2 expected=$3
  mkdir -p "$work/$name"
  printf '%s\n' "$text" > "$work/$name/index.json"
  output=$("$weave_ckpt" info "$work/$name" 2>&1)
  code=$?
  if [ "$code" -ne 1 ] || ! grep -q -- "$expected" <<<"$output" || grep -q "checksums: ok" <<<"$output" ||
     grep -qiE "json\.exception|filesystem_error|basic_string|std::" <<<"$output"; then
    echo "FAIL: $name: exit $code: $output"
    failed=1
  else
    echo "ok: $name: $output"
  fi
}
g='"generation": 1'
check empty-world "{\"format\": \"weave-sharded-2\", \"files\": [], \"world_size\": 0, $g}" \
  "expected a positive world_size"
check no-files "{\"format\": \"weave-sharded-2\", \"files\": [], \"world_size\": 2, $g}" \
  "it lists 0 files for 2 ranks"
check parent-dir "{\"format\": \"weave-sharded-2\", \"files\": [\"../x\"], \"world_size\": 1, $g}" \
  "is not a plain file name"
check dot-dot "{\"format\": \"weave-sharded-2\", \"files\": [\"..\"], \"world_size\": 1, $g}" \
  "is not a plain file name"
check unknown-format "{\"format\": \"weave-sharded-9\", \"files\": [\"a\"], \"world_size\": 1, $g}" \
  "expected format weave-sharded-2"
check string-world "{\"format\": \"weave-sharded-2\", \"files\": [\"a\"], \"world_size\": \"1\", $g}" \
  "expected a positive world_size"
check bad-checksums "{\"format\": \"weave-sharded-2\", \"files\": [\"a\"], \"world_size\": 1, $g, \"checksums\": [-1]}" \
  "a checksum is not a CRC-32"
check not-json "{ not json" "not a JSON object"
check missing-file "{\"format\": \"weave-sharded-2\", \"files\": [\"a.safetensors\"], \"world_size\": 1, $g}" \
  "a.safetensors"
output=$("$weave_ckpt" info "$work/nowhere" 2>&1)
if [ $? -ne 1 ] || grep -qiE "filesystem_error|std::" <<<"$output"; then
  echo "FAIL: a missing directory: $output"; failed=1
fi
[ "$failed" -eq 0 ] && echo "PASS: weave-ckpt refuses what the loader refuses"
exit $failed
