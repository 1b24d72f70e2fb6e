#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (docs/performance.md, "On a GPU"), in one run of under about 8
# minutes: the CUDA engine's tests, device shards saved and loaded in place over an NCCL group of
# min(GPUs, 4) ranks, compute-sanitizer's memcheck over the CUDA tests where it is installed, the
# demo with CUDA shards (async save, Adam state of a distributed optimizer, reload at another
# layout), and the bench's device figures. Everything is also written to $OUT/gpu-check.log when
# OUT is set. Exits 77 without a GPU, 1 when a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:+$OUT/gpu-check.log}
log=${log:-/dev/null}
say() { echo "$@" | tee -a "$log"; }
failed=0
run() {  # what, seconds, command...
  local what=$1 limit=$2; shift 2
  say "== $what"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  say "== $what: exit $rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=1
}

if ! nvidia-smi -L > /dev/null 2>&1; then
  say "gpu-check: no NVIDIA GPU here"
  exit 77
fi
nvidia-smi -L | tee -a "$log"
# Configured here unless the build directory came along; no packages are installed (the machine
# may have no network): the toolchain and libraries must already be there.
[ -f build/build.ninja ] || meson setup build --native-file scripts/clang.ini --buildtype=release > /dev/null
run "build" 300 meson compile -C build shardckpt shardckpt-bench tests/cuda_test tests/nccl_test

run "CUDA engine tests" 120 build/tests/cuda_test
run "NCCL: device shards saved and loaded in place" 120 build/tests/nccl_test
if command -v compute-sanitizer > /dev/null || [ -x /usr/local/cuda/bin/compute-sanitizer ]; then
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  run "compute-sanitizer memcheck" 240 "$sanitizer" --tool memcheck --error-exitcode 1 build/tests/cuda_test
else
  say "== compute-sanitizer: not installed, skipped"
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run "demo with CUDA shards" 120 build/shardckpt demo --out "$dir/demo.h5" --device cuda --async --optimizer adam \
  --distributed-optimizer --tp 2 --gtp 2 --align 16 --dp 2 --load-tp 1 --load-dp 4
run "load into CUDA shards" 60 build/shardckpt load "$dir/demo.h5" --tp 2 --gtp 1 --dp 2 --distributed-optimizer \
  --device cuda --verify
run "bench, device figures" 300 build/shardckpt-bench --device cuda --size-mib 1024 --repeat 3 --read-repeat 3 \
  --dp 1 --no-h5py --dir "$dir"
say "gpu-check: $([ $failed -eq 0 ] && echo "all checks passed" || echo "FAILED")"
exit $failed
