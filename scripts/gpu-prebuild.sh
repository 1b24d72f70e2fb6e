#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, for a GPU machine that has the NVIDIA driver and the CUDA
# runtime but not this project's toolchain (clang 19, HDF5's and range-v3's headers): a release
# build-gpu with CUDA and NCCL (no MPI, no Python), and DIR (default build-gpu-carry) with shardckpt,
# shardckpt-bench, tests/cuda_test, tests/nccl_test and lib/: libshardckpt and every library they
# load that is not the C and C++ runtime, the CUDA driver or NCCL (NCCL is 200 MB: the GPU machine
# brings its own, found by gpu-check.sh's caller through LD_LIBRARY_PATH). There:
#   GPU_CHECK_PREBUILT=DIR scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build-gpu-carry}
if [ ! -f build-gpu/build.ninja ]; then
  meson setup build-gpu --native-file scripts/clang.ini --buildtype=release -Dcuda=enabled -Dnccl=enabled \
    -Dmpi=disabled -Dpython=disabled
fi
meson compile -C build-gpu shardckpt:executable shardckpt-bench tests/cuda_test tests/nccl_test
rm -rf "$out"
mkdir -p "$out/tests" "$out/lib"
cp build-gpu/shardckpt build-gpu/shardckpt-bench "$out/"
cp build-gpu/tests/cuda_test build-gpu/tests/nccl_test "$out/tests/"
cp -L build-gpu/libshardckpt.so.0 "$out/lib/"
for bin in "$out"/shardckpt "$out"/shardckpt-bench "$out"/tests/*; do
  LD_LIBRARY_PATH=build-gpu ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libresolv.so*|libutil.so*|libanl.so*|libnsl.so*|ld-linux*|libgcc_s.so*|libstdc++.so*|libcuda.so*|libnccl.so*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
strip --strip-debug "$out"/shardckpt "$out"/shardckpt-bench "$out"/tests/* "$out"/lib/* 2>/dev/null || true
du -sh "$out"
