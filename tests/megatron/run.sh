#!/usr/bin/env bash
# The Megatron-core tests (tests/megatron/test_megatron.py) in build/peers-venv, where
# scripts/setup.sh --torch2 installs torch 2.x and megatron-core 0.16.1 from PyPI. Exit 77 (skipped,
# and said) when either is absent, which happens only when the setup could not reach PyPI.
venv=$1
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch, h5py, megatron.core.dist_checkpointing' 2>/dev/null; then
  echo "megatron: skipped: no torch 2.x with megatron-core in $venv (scripts/setup.sh makes it when PyPI is reachable)"
  exit 77
fi
unset PYTHONPATH  # the package as pip installed it there, not the build tree's
if ! "$venv/bin/python" -c 'import shardckpt' 2>/dev/null; then
  echo "megatron: $venv has no shardckpt: install it with scripts/pip-install.sh $venv (test.sh does)"
  exit 1
fi
"$venv/bin/python" -c 'import shardckpt, megatron.core; print(f"megatron: shardckpt {shardckpt.__version__}, megatron-core {megatron.core.__version__}")' 2>/dev/null
exec "$venv/bin/python" -W ignore -m unittest discover -v -s "$(dirname "$0")" -p 'test_*.py'
