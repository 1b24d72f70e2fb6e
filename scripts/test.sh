#!/usr/bin/env bash
# Builds and runs every test: the debugoptimized suite (with the 4-process MPI suite), then the same
# unit suites under ASan+UBSan. Ends with one line: "tests: N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --asan || exit 1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
meson compile -C build || exit 1
meson test -C build --print-errorlogs 2>&1 | tee -a "$log" || status=1
meson compile -C build-asan || exit 1
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  meson test -C build-asan --print-errorlogs --no-suite mpi 2>&1 | tee -a "$log" || status=1
count() { awk -v k="$1" '$1 == k":" { n += $2 } END { print n + 0 }' "$log"; }
echo "tests: $(count Ok) passed, $(($(count Fail) + $(count Timeout))) failed, $(count Skipped) skipped"
exit $status
