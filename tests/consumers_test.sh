#!/usr/bin/env bash
# The example consumers (examples/), as a new user builds them: the library installed into a
# temporary prefix and found through pkg-config (dependency('shardckpt') and `import shardckpt;`,
# nothing else), other toolchains stopped by one clear error, the C API from C and from a libtorch
# (C++17) program, and the tutorial with and without an installed copy. The programs run, and the
# tool loads, verifies, reshards and inspects what they saved.
# Usage: consumers_test.sh BUILD_DIR (a configured build of this repository)
# With SHARDCKPT_BUILD_LOCK set (a lock file of your own), every build takes that lock, so that test
# runs sharing a machine do not build at once; unset, builds take no lock (a name in a shared /tmp
# is another user's to plant).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd)
exe=$build/shardckpt
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
lock=${SHARDCKPT_BUILD_LOCK-}
locked() { if [ -n "$lock" ]; then flock "$lock" "$@"; else "$@"; fi; }
export lock
export -f locked  # for the checks that run through bash -c
passed=0 failed=0
check() { local what=$1; shift; if "$@" > "$work/out" 2>&1; then passed=$((passed + 1)); else
  failed=$((failed + 1)); echo "FAIL: $what"; tail -20 "$work/out"; fi; }

# pkg-config: install, then a project whose meson.build is dependency('shardckpt') and whose source
# imports shardckpt: it uses the installed precompiled interfaces as they are.
check "install into a temporary prefix" meson install -C "$build" --destdir "$work/dest" --no-rebuild
pc=$(dirname "$(find "$work/dest" -name shardckpt.pc | head -1)")
lib=$(dirname "$(find "$work/dest" -name 'libshardckpt.so' | head -1)")
check "the installed .pc maps every installed module to its installed BMI" bash -c "
  flags=\$(PKG_CONFIG_PATH='$pc' pkg-config --cflags shardckpt) &&
  for m in \$(PKG_CONFIG_PATH='$pc' pkg-config --variable=modules shardckpt | tr ';' ' '); do
    bmi=\$(echo \" \$flags\" | grep -o \"=/[^ =]*/\$m.pcm\") && [ -f \"\${bmi#=}\" ] || { echo \"no BMI for \$m\"; exit 1; }
  done"
# The Python package installed with it, where the prefix's /usr/bin/python3 looks (below the destdir).
check "the installed Python package imports from where it was installed" bash -c "
  site=\$(dirname \"\$(dirname \"\$(find '$work/dest' -path '*/shardckpt/__init__.py' | head -1)\")\") &&
  PYTHONPATH=\$site LD_LIBRARY_PATH='$lib' /usr/bin/python3 -c 'import shardckpt, sys; print(shardckpt.__file__)' |
    grep -q '^$work/dest/.*dist-packages/shardckpt/__init__.py\$'"
check "the pkg-config consumer is dependency('shardckpt') and nothing else" bash -c \
  "grep -v '^#' '$root/examples/pkgconfig/meson.build' | grep -c . | grep -qx 2"
check "configure the pkg-config consumer" locked env PKG_CONFIG_PATH="$pc" \
  meson setup "$work/pkgconfig" "$root/examples/pkgconfig" --native-file "$root/scripts/clang.ini"
check "build the pkg-config consumer" locked meson compile -C "$work/pkgconfig"
check "run the pkg-config consumer" env LD_LIBRARY_PATH="$lib" "$work/pkgconfig/save_and_reshard" "$work/consumer.h5"
check "load --verify a consumer's checkpoint" "$exe" load "$work/consumer.h5" --tp 2 --gtp 3 --align 8 --verify
check "verify a consumer's checkpoint" "$exe" verify "$work/consumer.h5"
check "reshard a consumer's checkpoint" "$exe" reshard "$work/consumer.h5" "$work/consumer-re.h5" --tp 1 --gtp 1 --align 0
check "resharded tensors are equal" h5diff --exclude-path /_shardckpt "$work/consumer.h5" "$work/consumer-re.h5"
check "inspect a consumer's checkpoint" bash -c "'$exe' inspect '$work/consumer.h5' --json | /usr/bin/python3 -c \
  'import json, sys; d = json.load(sys.stdin); assert len(d[\"tensors\"]) == 10 and len(d[\"params\"]) == 2, d'"

# Another toolchain with the installed flags: one error, from include/shardckpt/toolchain_check.h,
# that says what to use, then the stop (no cascade from `import`). Args: expected text, compiler...
one_error() {
  local expect=$1; shift
  ! locked "$@" $(PKG_CONFIG_PATH="$pc" pkg-config --cflags shardckpt) -c "$root/examples/pkgconfig/save_and_reshard.cpp" \
    -o "$work/never.o" > "$work/diag" 2>&1 || { echo "it compiled"; return 1; }
  cat "$work/diag"
  grep -q "toolchain_check.h:[0-9]*:[0-9]*: error: .*shardckpt: .*$expect" "$work/diag" || { echo "no clear error"; return 1; }
  [ "$(grep -c 'error:' "$work/diag")" -eq 2 ] && grep -q "fatal error: .*shardckpt: compilation stopped" "$work/diag"
}
check "g++ gets one error: use clang++-19" one_error "this compiler is not clang (g++?).*compile with clang++-19 -std=c++20" g++ -std=c++20
check "-std=c++17 gets one error: use -std=c++20" one_error "another language standard.*compile with exactly -std=c++20" \
  clang++-19 -std=c++17
check "-std=gnu++20 gets one error: use -std=c++20" one_error "another language standard.*exactly -std=c++20" \
  clang++-19 -std=gnu++20
check "-stdlib=libc++ gets one error: use libstdc++" one_error "another standard library than libstdc++" \
  clang++-19 -std=c++20 -stdlib=libc++
check "a C compiler gets one error: use shardckpt-c" one_error "is for C++.*pkg-config shardckpt-c" clang-19 -x c
if command -v clang++-14 > /dev/null; then
  check "clang++-14 gets one error: use clang++-19" one_error "this clang is not clang 19" clang++-14 -std=c++20
fi
check "a Meson consumer at cpp_std=c++17 stops at the same error" bash -c "
  locked env PKG_CONFIG_PATH='$pc' meson setup '$work/pkgconfig17' '$root/examples/pkgconfig' \
    --native-file '$root/scripts/clang.ini' -Dcpp_std=c++17 > /dev/null &&
  ! locked meson compile -C '$work/pkgconfig17' > '$work/diag17' 2>&1 &&
  grep -q 'shardckpt: this file is compiled with another language standard.*exactly -std=c++20' '$work/diag17'"

# The C API, from C (pkg-config shardckpt-c: a header and the library, no module flags).
check "build the C example against shardckpt-c" bash -c "
  locked cc -std=c99 -Wall -Wextra -pedantic -Werror \$(PKG_CONFIG_PATH='$pc' pkg-config --cflags shardckpt-c) \
    '$root/examples/c/save_load.c' -o '$work/save_load' \$(PKG_CONFIG_PATH='$pc' pkg-config --libs shardckpt-c)"
check "run the C example" env LD_LIBRARY_PATH="$lib" "$work/save_load" "$work/c.h5"
check "verify the C example's checkpoint" "$exe" verify "$work/c.h5"

# The C API from libtorch (C++17, g++): a fused GDP in_proj saved as GTP shards, loaded at another layout.
if [ -f /usr/include/torch/csrc/api/include/torch/torch.h ]; then
  check "configure the libtorch example" locked env PKG_CONFIG_PATH="$pc" meson setup "$work/libtorch" "$root/examples/libtorch"
  check "build the libtorch example" locked meson compile -C "$work/libtorch"
  check "run the libtorch example (bit-equal after GTP 2 -> GTP 3)" bash -c \
    "LD_LIBRARY_PATH='$lib' '$work/libtorch/in_proj' '$work/torch.h5' > '$work/torch.out'; s=\$?; cat '$work/torch.out';
     [ \$s -eq 0 ] && grep -q 'weight bit-equal, 12 pad rows zero, output equal' '$work/torch.out'"
  check "load --verify the libtorch example's checkpoint" "$exe" load "$work/torch.h5" --tp 1 --gtp 4 --align 4 --verify
else
  echo "SKIP: the libtorch example (no libtorch-dev: scripts/setup.sh installs it)"
fi

# The tutorial's project, with this repository at subprojects/shardckpt: without an installed copy it
# builds the subproject; with one on PKG_CONFIG_PATH it uses it; an older installed one is passed over.
tutorial() {  # directory: a copy of the project
  mkdir -p "$1/subprojects" && cp "$root"/examples/subproject/* "$1/" && ln -s "$root" "$1/subprojects/shardckpt"
}
tutorial "$work/tutorial"
no_installed=()
PKG_CONFIG_PATH= pkg-config --exists shardckpt && no_installed=(--force-fallback-for=shardckpt)  # one on this machine
check "configure the tutorial without an installed copy (the subproject)" bash -c "
  locked meson setup '$work/tutorial/build' '$work/tutorial' --native-file '$work/tutorial/subprojects/shardckpt/scripts/clang.ini' \
    ${no_installed[*]} > '$work/setup.log' && cat '$work/setup.log' && grep -q 'Executing subproject shardckpt' '$work/setup.log'"
check "build the tutorial" locked meson compile -C "$work/tutorial/build"
check "run the tutorial" bash -c "cd '$work/tutorial' && build/tutorial"
check "h5py reads the tutorial's checkpoints" bash -c "cd '$work/tutorial' && /usr/bin/python3 read.py"
check "run the training loop (async saves from device memory, a restart in place)" \
  bash -c "cd '$work/tutorial' && build/training_loop"
check "load --verify the training loop's checkpoint" "$exe" load "$work/tutorial/training.h5" --tp 2 --gtp 1 --verify
check "verify the resharded tutorial checkpoint" "$exe" verify "$work/tutorial/resharded.h5"

tutorial "$work/tutorial-installed"
check "configure the tutorial with an installed copy (no subproject)" bash -c "
  locked env PKG_CONFIG_PATH='$pc' meson setup '$work/tutorial-installed/build' '$work/tutorial-installed' \
    --native-file '$root/scripts/clang.ini' > '$work/setup.log' && cat '$work/setup.log' &&
  grep -q 'Run-time dependency shardckpt found: YES' '$work/setup.log' && ! grep -q 'Executing subproject' '$work/setup.log'"
check "build the tutorial against the installed copy" locked meson compile -C "$work/tutorial-installed/build"
check "run the tutorial built against the installed copy" bash -c \
  "cd '$work/tutorial-installed' && LD_LIBRARY_PATH='$lib' build/tutorial && LD_LIBRARY_PATH='$lib' build/training_loop"
check "its checkpoints equal the subproject build's" h5diff --exclude-path /_shardckpt \
  "$work/tutorial/resharded.h5" "$work/tutorial-installed/resharded.h5"

mkdir -p "$work/old-pc" && sed 's/^Version: .*/Version: 0.2.0/' "$pc/shardckpt.pc" > "$work/old-pc/shardckpt.pc"
tutorial "$work/tutorial-old"
check "configure the tutorial with an older installed copy: the subproject" bash -c "
  locked env PKG_CONFIG_PATH='$work/old-pc' meson setup '$work/tutorial-old/build' '$work/tutorial-old' \
    --native-file '$root/scripts/clang.ini' > '$work/setup.log' && cat '$work/setup.log' &&
  grep -q 'Executing subproject shardckpt' '$work/setup.log'"

# The h5py scripts of docs/format-walkthrough.md, on a fresh demo checkpoint: each reads what it
# says, and each check fails on a file damaged where it looks.
h5=$root/examples/h5py
py=/usr/bin/python3
check "save a demo checkpoint for the h5py scripts" "$exe" demo --out "$work/doc.h5" --quiet
check "h5py reads a checkpoint (read_checkpoint.py)" bash -c "$py '$h5/read_checkpoint.py' '$work/doc.h5' | grep -q '^2 global '"
check "h5py recomputes every checksum (recompute_checksums.py)" bash -c \
  "$py '$h5/recompute_checksums.py' '$work/doc.h5' | grep -Eq '^([0-9]+) of \\1 rows match their checksums$'"
check "the seal checks by hand (check_seal.py)" "$py" "$h5/check_seal.py" "$work/doc.h5"
check "damage the demo checkpoint (a tensor bit, a metadata bit)" "$py" -c "
import h5py
src = '$work/doc.h5'
with h5py.File(src, 'r') as f:
    at = f['decoder.layers.0.mixer.in_proj.weight.z'].id.get_offset() + 3 * 512 + 5
for name, offset in (('bad-data.h5', at), ('bad-meta.h5', 100)):
    b = bytearray(open(src, 'rb').read()); b[offset] ^= 1; open('$work/' + name, 'wb').write(b)"
check "recompute_checksums.py finds a flipped tensor bit" bash -c \
  "! $py '$h5/recompute_checksums.py' '$work/bad-data.h5' 2> '$work/err' && grep -q 'weight.z: row 3 does not match' '$work/err'"
check "check_seal.py finds a flipped metadata bit" bash -c "! $py '$h5/check_seal.py' '$work/bad-meta.h5'"
# A layer-stacked weight split on its last dim (as Megatron's row-parallel layers are) is chunked one
# band of dim 2 wide: recompute_checksums.py finds each checksummed run inside its chunk.
site=$(dirname "$(dirname "$(find "$work/dest" -path '*/shardckpt/__init__.py' | head -1)")")
check "save a layer-stacked weight split on its last dim" env PYTHONPATH="$site" LD_LIBRARY_PATH="$lib" "$py" -c "
import torch, shardckpt as sc
w, s = torch.arange(3 * 4 * 6, dtype=torch.float32).reshape(3, 4, 6), sc.StateDict()
for l in range(3):
    for c0 in (0, 3):
        s.add(sc.ShardedTensor('w', w[l:l + 1, :, c0:c0 + 3].contiguous(), [3, 4, 6], [l, 0, c0]))
sc.save(s, '$work/stacked.h5')"
check "h5py reads it chunked one band of dim 2 wide" "$py" -c "
import h5py, numpy as np
d = h5py.File('$work/stacked.h5', 'r')['w']
assert d.chunks == (3, 4, 3) and (d[()] == np.arange(72).reshape(3, 4, 6)).all(), d.chunks"
check "h5py recomputes every checksum of it" bash -c \
  "$py '$h5/recompute_checksums.py' '$work/stacked.h5' | grep -q '^24 of 24 rows match their checksums$'"
check "recompute_checksums.py finds a flipped bit in its second band" bash -c "
$py -c \"
import h5py
with h5py.File('$work/stacked.h5', 'r') as f:
    at = f['w'].id.get_chunk_info_by_coord((0, 0, 3)).byte_offset + 5 * 4   # layer 0, row 1 of dim 1, column 5
b = bytearray(open('$work/stacked.h5', 'rb').read()); b[at] ^= 1; open('$work/bad-stacked.h5', 'wb').write(b)\" &&
! $py '$h5/recompute_checksums.py' '$work/bad-stacked.h5' 2> '$work/err' && grep -q '^w: row 0 does not match' '$work/err'"
check "make_v1.py makes a plain file a version 1 checkpoint" bash -c "
$py -c \"import h5py, numpy as np; h5py.File('$work/v1.h5', 'w')['w'] = np.arange(12, dtype=np.float32).reshape(6, 2)\" &&
$py '$h5/make_v1.py' '$work/v1.h5' && '$exe' inspect '$work/v1.h5' | grep -q 'format version 1'"

echo "consumers: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
