#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (docs/performance.md, "On a GPU"), in one run of under 8
# minutes: the CUDA engine's tests (the bounded async path among them), device shards saved and
# loaded in place over an NCCL group of min(GPUs, 4) ranks (one rank per GPU: NCCL does not support
# two ranks on one device), compute-sanitizer's memcheck over the CUDA tests where it is installed,
# the demo with CUDA shards (async save, Adam state of a distributed optimizer, reload at another
# layout), torch CUDA tensors through DLPack saved in the background through a bounded budget (where
# the Python package builds and torch has CUDA), and the bench's device figures and bounded async
# saves from CUDA memory. Everything is also written to $OUT/gpu-check.log, and the bench's JSON to
# $OUT/bench-cuda.json and $OUT/bench-async-bounded.json, when OUT is set. Exits 77 without a GPU,
# 1 when a check fails or is cut short. On a GPU machine without the toolchain, run it over binaries
# built elsewhere: scripts/gpu-prebuild.sh here, then GPU_CHECK_PREBUILT=build-gpu-carry there.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:+$OUT/gpu-check.log}
log=${log:-/dev/null}
say() { echo "$@" | tee -a "$log"; }
failed=0
deadline=470  # seconds: every step is cut to what is left of the 8 minutes
run() {  # what, seconds, command...
  local what=$1 limit=$2; shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 15 ]; then
    say "== $what: not run, the 8 minutes are spent"
    failed=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  say "== $what (at most $limit s)"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "== $what: exit $rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=1
}

if ! nvidia-smi -L > /dev/null 2>&1; then
  say "gpu-check: no NVIDIA GPU here"
  exit 77
fi
nvidia-smi -L | tee -a "$log"
gpus=$(nvidia-smi -L | grep -c '^GPU')
# GPU_CHECK_PREBUILT=DIR: binaries built on another machine, for a GPU machine without the toolchain
# (scripts/gpu-prebuild.sh makes DIR: shardckpt, shardckpt-bench, tests/cuda_test, tests/nccl_test,
# and lib/ with the libraries they need that such a machine may lack). Nothing is built then, and the
# Python step is skipped (the extension is built for this project's Python, not the GPU machine's).
b=build-gpu
core=""
nccl=0
if [ -n "${GPU_CHECK_PREBUILT:-}" ]; then
  b=$GPU_CHECK_PREBUILT
  export LD_LIBRARY_PATH="$PWD/$b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -x "$b/tests/nccl_test" ] && nccl=1
  say "prebuilt binaries in $b"
else
# A build of its own with CUDA required (NCCL where it is installed). No packages are installed:
# the machine may have no network, so the toolchain and libraries must already be there.
if [ ! -f build-gpu/build.ninja ]; then
  run "configure" 120 meson setup build-gpu --native-file scripts/clang.ini --buildtype=release -Dcuda=enabled
  [ -f build-gpu/build.ninja ] || { say "gpu-check: FAILED (the build cannot be configured)"; exit 1; }
fi
targets=(shardckpt:executable shardckpt-bench tests/cuda_test)
grep -q 'tests/nccl_test:' build-gpu/build.ninja && nccl=1 && targets+=(tests/nccl_test)
# The Python extension, when the build has it (its target's name carries the interpreter's suffix).
core=$(meson introspect build-gpu --targets 2>/dev/null | /usr/bin/python3 -c \
  'import json, sys; print(next((t["name"] for t in json.load(sys.stdin) if t["name"].startswith("_core.")), ""))' \
  2>/dev/null)
[ -n "$core" ] && targets+=("$core")
run "build" 300 meson compile -C build-gpu "${targets[@]}"
[ "$failed" -eq 0 ] || { say "gpu-check: FAILED (the build)"; exit 1; }
fi

run "CUDA engine tests" 90 "$b"/tests/cuda_test
if [ "$nccl" -eq 1 ]; then
  say "NCCL ranks: $((gpus < 4 ? gpus : 4)) (one per GPU)"
  run "NCCL: device shards saved and loaded in place" 90 "$b"/tests/nccl_test
else
  say "== NCCL: not installed, skipped"
fi
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$sanitizer" ]; then
  run "compute-sanitizer memcheck" 150 "$sanitizer" --tool memcheck --error-exitcode 1 "$b"/tests/cuda_test
else
  say "== compute-sanitizer: not installed, skipped"
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run "demo with CUDA shards" 90 "$b"/shardckpt demo --out "$dir/demo.h5" --device cuda --async --optimizer adam \
  --distributed-optimizer --tp 2 --gtp 2 --align 16 --dp 2 --load-tp 1 --load-dp 4
run "load into CUDA shards" 60 "$b"/shardckpt load "$dir/demo.h5" --tp 2 --gtp 1 --dp 2 --distributed-optimizer \
  --device cuda --verify
if [ -z "$core" ]; then
  say "== torch CUDA tensors: no Python extension built here (or prebuilt binaries), skipped"
elif ! /usr/bin/python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  say "== torch CUDA tensors: /usr/bin/python3 has no torch with CUDA, skipped"
else
  mkdir -p "$dir/py/shardckpt"
  cp python/shardckpt/*.py build-gpu/python/shardckpt/_core.*.so "$dir/py/shardckpt/"
  run "torch CUDA tensors through DLPack: a bounded async save, a load in place" 90 \
    bash -c 'cd tests/python && PYTHONPATH="$0" /usr/bin/python3 -m unittest -v test_cuda' "$dir/py"
fi
bounded=${OUT:+$OUT/bench-async-bounded.json}
run "bench, bounded async saves from CUDA memory" 150 env B="$b" bash -c 'set -o pipefail; "$B"/shardckpt-bench "$@" | tee "$0"' \
  "${bounded:-/dev/null}" --only async-bounded --device cuda --size-mib 1024 --repeat 3 --json --dir "$dir"
json=${OUT:+$OUT/bench-cuda.json}
run "bench, device figures" 240 env B="$b" bash -c 'set -o pipefail; "$B"/shardckpt-bench "$@" | tee "$0"' "${json:-/dev/null}" --device cuda \
  --size-mib 1024 --repeat 3 --read-repeat 3 --dp 1 --no-h5py --json --dir "$dir"
say "gpu-check: $([ $failed -eq 0 ] && echo "all checks passed" || echo "FAILED") in $SECONDS s"
exit $failed
