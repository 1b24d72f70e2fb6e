#!/usr/bin/env bash
# The main job: set up, build, and run the demo (save, reload at another layout, verify).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
meson compile -C build >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
build/shardckpt demo --out "$out/demo.h5" "$@"
