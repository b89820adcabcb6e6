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
