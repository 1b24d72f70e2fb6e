#!/usr/bin/env bash
# Installs every package shardckpt needs (Debian 12), configures build/ (and build-asan/ with
# --asan) and makes .venv-safetensors (Hugging Face's safetensors from PyPI, for the tests).
# Idempotent: quiet when everything is already there.
#
# --torch2 (test.sh): also makes build/peers-venv, a virtual environment of /usr/bin/python3 with
# torch 2.x, megatron-core 0.16.1, safetensors, numpy, h5py, packaging, psutil and einops from PyPI,
# for the torch 2.x tests (tests/torch2: DTensors, torch.distributed.checkpoint; tests/megatron:
# Megatron's dist_checkpointing), which are skipped, and say so, when PyPI cannot be reached; and
# build/megatron-0.19.2, megatron-core 0.19.2 (GTP) with nvidia-resiliency-ext 0.6.0, for
# PYTHONPATH= beside that environment (tests/megatron runs again with it). Their wheels say Python
# >= 3.12, their code runs on Debian 12's 3.11: pip takes them for 3.12 (--python-version), without
# their dependencies, which the environment has.
# PyPI's torch for Linux is a CUDA build: with its nvidia-* wheels about 3 GB to download and 5.5 GB
# installed; it runs on the CPU as well. The other Python tests run Debian's python3-torch 1.13.
# --peers (not part of demo.sh or test.sh): --torch2, and builds build/ and installs the package into
# that environment with pip (scripts/pip-install.sh), for bench/peers.py. test.sh installs it there
# too (scripts/pip-check.sh), so the torch 2.x tests run the package as pip installs it.
set -euo pipefail
cd "$(dirname "$0")/.."

asan=false peers=false torch2=false
for arg in "$@"; do
  case "$arg" in
    --asan) asan=true ;;
    --peers) peers=true torch2=true ;;
    --torch2) torch2=true ;;
    *) echo "usage: scripts/setup.sh [--asan] [--torch2] [--peers]" >&2; exit 2 ;;
  esac
done

packages=(meson ninja-build clang-19 lld-19 clang-tools-19 libclang-rt-19-dev
          libhdf5-dev hdf5-tools librange-v3-dev libgtest-dev pkg-config
          nlohmann-json3-dev libcli11-dev openmpi-bin libopenmpi-dev
          python3-h5py python3-numpy python3-xxhash libxxhash-dev python3-venv libtorch-dev
          python3-dev pybind11-dev libdlpack-dev python3-torch python3-matplotlib patchelf)
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
  if [ -f "$dir/build.ninja" ]; then
    # Options this script gives the directory that it did not have when made: set them there.
    [ "$(cat "$dir/.setup-options" 2>/dev/null)" = "$*" ] && return 0
    [ $# -eq 0 ] || meson configure "$dir" "$@" >/dev/null
  else
    meson setup "$dir" --native-file scripts/clang.ini --buildtype=debugoptimized "$@" >/dev/null
  fi
  echo "$*" > "$dir/.setup-options"
}
configure build
# Hugging Face's safetensors (PyPI) in a virtual environment for tests/safetensors_test.py, which is
# skipped without it (no network, say).
scripts/safetensors-venv.sh .venv-safetensors || echo "setup: tests/safetensors_test.py will be skipped"
if $asan; then
  # The library, the tool and the unit suites under the sanitizers; the bench is a program of its
  # own, which the plain build runs (tests/bench_smoke.py).
  configure build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dfuzz=true -Dbench=disabled
fi

venv=build/peers-venv
if $torch2; then
  # The extension is built for /usr/bin/python3, so the environment is made from it, without the
  # system's packages (Debian's torch 1.13 would shadow torch 2.x).
  [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
  if ! "$venv/bin/python" -c 'import torch, safetensors, numpy, h5py, packaging, psutil, einops, megatron.core
assert int(torch.__version__.split(".")[0]) >= 2 and megatron.core.__version__ == "0.16.1"' 2>/dev/null; then
    # megatron-core 0.16.1 is the newest that pip installs for Python 3.11 as it is; its torch_dist
    # backend needs psutil, which it does not declare; 0.19's Mamba layers need einops.
    echo "setup: installing torch 2.x, megatron-core 0.16.1, safetensors, numpy, h5py, packaging, psutil and einops from PyPI into $venv (about 3 GB)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch>=2.8" megatron-core==0.16.1 safetensors \
      numpy h5py packaging psutil einops \
      || echo "setup: no torch 2.x or megatron-core (PyPI unreachable?): the torch 2.x and Megatron tests will be skipped"
  fi
  mc19=build/megatron-0.19.2
  if ! PYTHONPATH=$mc19 "$venv/bin/python" -c 'import megatron.core, nvidia_resiliency_ext
assert megatron.core.__version__.split("+")[0] == "0.19.2"' 2>/dev/null; then
    echo "setup: installing megatron-core 0.19.2 and nvidia-resiliency-ext 0.6.0 from PyPI into $mc19"
    rm -rf "$mc19"
    pip3=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --ignore-requires-python
          --only-binary=:all: --python-version 3.12 --implementation cp --target "$mc19")
    { "${pip3[@]}" megatron-core==0.19.2 \
      && "${pip3[@]}" --platform manylinux_2_39_x86_64 nvidia-resiliency-ext==0.6.0; } \
      || { rm -rf "$mc19"; echo "setup: no megatron-core 0.19.2 (PyPI unreachable?): its Megatron tests will be skipped"; }
  fi
fi
if $peers; then
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -f "$site/shardckpt-build.pth"  # made by earlier setups: the package comes by pip now
  ninja -C build >/dev/null
  scripts/pip-install.sh "$venv" -q
  "$venv/bin/python" -c 'import shardckpt, torch, safetensors
print(f"setup: {shardckpt.__file__} with torch {torch.__version__} and safetensors {safetensors.__version__}")'
fi
