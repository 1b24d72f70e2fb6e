#!/usr/bin/env bash
# Builds and runs every test: the debugoptimized suite (with the 4-process MPI suite and the CLI
# tests), the unit suites again under ASan+UBSan, the hostile-file generator against the sanitized
# tool, a bounded libFuzzer run over the seed corpus, the kill tests, the two example consumers
# (installed library through pkg-config, and subproject), and the documentation's excerpts and
# links. Ends with one line: "tests: N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --asan || exit 1
log=$(mktemp)
work=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null; wait; rm -rf "$log" "$work"' EXIT
status=0
# torch 2.x and megatron-core (several GB from PyPI: mostly waiting on the network) come while the
# plain build compiles; the package goes into that environment once both are done.
scripts/setup.sh --torch2 > "$work/setup-torch2.log" 2>&1 &
torch2_setup=$!
meson compile -C build || { wait $torch2_setup; exit 1; }
wait $torch2_setup || { cat "$work/setup-torch2.log"; exit 1; }
cat "$work/setup-torch2.log"
# pip install . as users do, into a fresh venv and into build/peers-venv, whose torch 2.x tests
# (tests/torch2, in the meson tests) then run the installed package.
scripts/pip-check.sh 2>&1 | tee -a "$log" || status=1
meson test -C build --print-errorlogs 2>&1 | tee -a "$log" || status=1
meson compile -C build-asan || exit 1
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  meson test -C build-asan --print-errorlogs --no-suite mpi 2>&1 | tee -a "$log" || status=1

# The fuzzer, for about a minute from the seed corpus (its finds stay in $work), on one core while
# the hostile files and the kill tests (which mostly wait on their processes) take the other. A
# crash it finds is kept: copy the input it names into tests/fuzz/regressions/, which the unit tests
# replay.
mkdir -p "$work/corpus"
cp tests/fuzz/corpus/* "$work/corpus/"
ASAN_OPTIONS=detect_leaks=1 build-asan/tests/fuzz_reader -max_total_time=60 -max_len=65536 -timeout=10 \
  -rss_limit_mb=2048 -artifact_prefix="$work/" "$work/corpus" > "$work/fuzz.log" 2>&1 &
fuzz=$!

# Hostile files through every command of the sanitized tool.
/usr/bin/python3 tests/hostile_test.py build-asan/shardckpt 2>&1 | tee -a "$log" || status=1

# SIGKILLed saves: the path always holds a complete checkpoint that verifies.
/usr/bin/python3 tests/kill_test.py build/shardckpt 2>&1 | tee -a "$log" || status=1

if wait $fuzz; then
  echo "fuzz: $(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$work/fuzz.log"), no crash"
  echo "fuzz: 1 passed, 0 failed" | tee -a "$log"
else
  tail -40 "$work/fuzz.log"
  echo "fuzz: crashed; keep the input: cp $work/crash-* tests/fuzz/regressions/"
  echo "fuzz: 0 passed, 1 failed" | tee -a "$log"
  mkdir -p build/fuzz-crashes && cp "$work"/crash-* "$work"/leak-* "$work"/timeout-* build/fuzz-crashes/ 2> /dev/null
  status=1
fi

# What a new user builds: the examples, against an installed library and as a subproject.
bash tests/consumers_test.sh build 2>&1 | tee -a "$log" || status=1
/usr/bin/python3 tests/docs_test.py 2>&1 | tee -a "$log" || status=1

count() { awk -v k="$1" '$1 == k":" { n += $2 } END { print n + 0 }' "$log"; }
scripts=$(awk '/^(hostile files|fuzz|kill test|consumers|docs|pip): [0-9]+ passed, [0-9]+ failed$/ { p += $(NF-3); f += $(NF-1) } END { print p + 0, f + 0 }' "$log")
echo "tests: $(($(count Ok) + ${scripts% *})) passed, $(($(count Fail) + $(count Timeout) + ${scripts#* })) failed, $(count Skipped) skipped"
exit $status
