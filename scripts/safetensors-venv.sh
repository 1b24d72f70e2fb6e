#!/usr/bin/env bash
# Makes DIR (default: .venv-safetensors in the repository) a virtual environment of /usr/bin/python3
# that sees the system's packages (numpy, h5py, Debian's torch) and holds Hugging Face's safetensors
# from PyPI: what tests/safetensors_test.py writes its files with. Idempotent: does nothing when
# DIR already imports safetensors. Exits 1, saying why, when it cannot (no python3-venv, no network).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.venv-safetensors}
version=0.8.0  # the release the tests were written against
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import safetensors" 2> /dev/null; then
  exit 0
fi
if ! /usr/bin/python3 -m venv --system-site-packages "$dir" > /dev/null; then
  echo "safetensors-venv: /usr/bin/python3 cannot make a virtual environment (apt-get install python3-venv)" >&2
  exit 1
fi
if ! "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --timeout 20 --retries 1 \
    "safetensors==$version" > "$dir/pip.log" 2>&1; then
  echo "safetensors-venv: pip could not install safetensors==$version from PyPI into $dir ($dir/pip.log)" >&2
  exit 1
fi
