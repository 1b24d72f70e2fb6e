#!/usr/bin/env bash
# pip install of this checkout into virtual environment VENV, with the checks pip cannot make:
#   scripts/pip-install.sh VENV [pip options...]     e.g. scripts/pip-install.sh .venv '.[torch]'
# (a first argument after VENV that starts with '.' names what to install, extras included; the
# default is '.'). The build directory build-pip/ is kept, so a second install rebuilds only what
# changed. Exit 2 with one line saying what to do when VENV has no Python or no pip, or clang++-19
# (which C++20 modules need) is missing.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:?usage: scripts/pip-install.sh VENV [what] [pip options...]}
shift
what=.
if [ $# -gt 0 ] && [[ $1 == .* ]]; then what=$1; shift; fi
if [ ! -x "$venv/bin/python" ]; then
  echo "pip-install: $venv is not a virtual environment (no bin/python): make one with /usr/bin/python3 -m venv $venv" >&2
  exit 2
fi
if ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
  echo "pip-install: $venv has no pip: run $venv/bin/python -m ensurepip --upgrade, or make it again with /usr/bin/python3 -m venv $venv (Debian: apt-get install python3-venv)" >&2
  exit 2
fi
if ! command -v clang++-19 >/dev/null 2>&1; then
  echo "pip-install: no clang++-19, which shardckpt's C++20 modules need: apt-get install clang-19 lld-19 libclang-rt-19-dev (scripts/setup.sh installs every package the build needs)" >&2
  exit 2
fi
cd "$root" && exec "$venv/bin/python" -m pip install --disable-pip-version-check "$what" \
  --config-settings=build-dir="$root/build-pip" "$@"
