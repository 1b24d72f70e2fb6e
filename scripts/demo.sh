#!/usr/bin/env bash
# The main job: set up, build, and run the demo: weights and Adam state (a distributed optimizer's
# flat ranges) in emulated device memory, saved in the background at TP 2 x GTP 2 x DP 2, reloaded in
# place at TP 1 x GTP 4 x DP 3, every value verified. Arguments replace those flags.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
meson compile -C build >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [ $# -eq 0 ]; then
  set -- --optimizer adam --distributed-optimizer --dp 2 --load-dp 3 --device emulated --async
fi
build/shardckpt demo --out "$out/demo.h5" "$@"
