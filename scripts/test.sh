#!/usr/bin/env bash
# Builds and runs every test: the debugoptimized suite, then the same suite under ASan+UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --asan
meson compile -C build
meson test -C build --print-errorlogs
meson compile -C build-asan
ASAN_OPTIONS=detect_leaks=1 meson test -C build-asan --print-errorlogs --no-suite mpi
