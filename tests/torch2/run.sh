#!/usr/bin/env bash
# The torch 2.x tests (tests/torch2/test_torch2.py) in the virtual environment scripts/setup.sh
# makes with torch 2.x from PyPI: VENV_DIR/bin/python. Exit 77 (skipped, and said) when it is absent,
# which happens only when the setup could not reach PyPI.
venv=$1
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch, h5py; assert int(torch.__version__.split(".")[0]) >= 2' 2>/dev/null; then
  echo "torch2: skipped: no torch 2.x in $venv (scripts/setup.sh makes it when PyPI is reachable)"
  exit 77
fi
# The package as pip installed it there, not the build tree's.
unset PYTHONPATH
if ! "$venv/bin/python" -c 'import shardckpt' 2>/dev/null; then
  echo "torch2: $venv has no shardckpt: install it with scripts/pip-install.sh $venv (test.sh does)"
  exit 1
fi
"$venv/bin/python" -c 'import shardckpt; print(f"torch2: shardckpt {shardckpt.__version__} from {shardckpt.__file__}")'
exec "$venv/bin/python" -m unittest discover -v -s "$(dirname "$0")" -p 'test_*.py'
