#!/usr/bin/env bash
# The Megatron-core tests (tests/megatron/test_*.py) in build/peers-venv, where scripts/setup.sh
# --torch2 installs torch 2.x and megatron-core 0.16.1 from PyPI; with a second argument, a directory
# (build/megatron-0.19.2) put on PYTHONPATH ahead of that environment's megatron-core: the same tests
# against megatron-core 0.19.2 (and nvidia-resiliency-ext). Exit 77 (skipped, and said) when either
# is absent, which happens only when the setup could not reach PyPI.
venv=$1
over=${2:-}
unset PYTHONPATH  # the package as pip installed it there, not the build tree's
if [ -n "$over" ]; then
  if [ ! -d "$over/megatron" ]; then
    echo "megatron: skipped: no megatron-core in $over (scripts/setup.sh --torch2 puts 0.19.2 there when PyPI is reachable)"
    exit 77
  fi
  export PYTHONPATH=$over
fi
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch, h5py, megatron.core.dist_checkpointing' 2>/dev/null; then
  echo "megatron: skipped: no torch 2.x with megatron-core in $venv (scripts/setup.sh makes it when PyPI is reachable)"
  exit 77
fi
if ! "$venv/bin/python" -c 'import shardckpt' 2>/dev/null; then
  echo "megatron: $venv has no shardckpt: install it with scripts/pip-install.sh $venv (test.sh does)"
  exit 1
fi
"$venv/bin/python" -W ignore -c 'import shardckpt, megatron.core; print(f"megatron: shardckpt {shardckpt.__version__}, megatron-core {megatron.core.__version__}")' 2>/dev/null
exec "$venv/bin/python" -W ignore -m unittest discover -v -s "$(dirname "$0")" -p 'test_*.py'
