#!/usr/bin/env bash
# Installs every package shardckpt needs (Debian 12), configures build/ (and build-asan/ with
# --asan) and makes .venv-safetensors (Hugging Face's safetensors from PyPI, for the tests).
# Idempotent: quiet when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(meson ninja-build clang-19 lld-19 clang-tools-19 libclang-rt-19-dev
          libhdf5-dev hdf5-tools librange-v3-dev libgtest-dev pkg-config
          nlohmann-json3-dev libcli11-dev openmpi-bin libopenmpi-dev
          python3-h5py python3-numpy python3-xxhash libxxhash-dev python3-venv libtorch-dev
          python3-dev pybind11-dev libdlpack-dev python3-torch python3-matplotlib)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

configure() {  # dir, extra meson options...
  local dir=$1; shift
  [ -f "$dir/build.ninja" ] && return 0
  meson setup "$dir" --native-file scripts/clang.ini --buildtype=debugoptimized "$@" >/dev/null
}
configure build
# Hugging Face's safetensors (PyPI) in a virtual environment for tests/safetensors_test.py, which is
# skipped without it (no network, say).
scripts/safetensors-venv.sh .venv-safetensors || echo "setup: tests/safetensors_test.py will be skipped"
if [ "${1:-}" = "--asan" ]; then
  configure build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dfuzz=true
fi
