#!/usr/bin/env bash
# The torch 2.x tests (tests/torch2/test_torch2.py) in the virtual environment scripts/setup.sh
# makes with torch 2.x from PyPI: VENV_DIR/bin/python. Exit 77 (skipped, and said) when it is absent,
# which happens only when the setup could not reach PyPI.
venv=$1
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch, h5py; assert int(torch.__version__.split(".")[0]) >= 2' 2>/dev/null; then
  echo "torch2: skipped: no torch 2.x in $venv (scripts/setup.sh makes it when PyPI is reachable)"
  exit 77
fi
exec "$venv/bin/python" -m unittest discover -v -s "$(dirname "$0")" -p 'test_*.py'
