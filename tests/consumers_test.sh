#!/usr/bin/env bash
# The two example consumers (examples/), as a new user builds them: the library installed into a
# temporary prefix and found through pkg-config, and the library as a Meson subproject (the
# tutorial). Both programs run, and the tool loads, verifies, reshards and inspects what they saved.
# Usage: consumers_test.sh BUILD_DIR (a configured build of this repository)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "$1" && pwd)
exe=$build/shardckpt
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() { local what=$1; shift; if "$@" > "$work/out" 2>&1; then passed=$((passed + 1)); else
  failed=$((failed + 1)); echo "FAIL: $what"; tail -20 "$work/out"; fi; }

# pkg-config: install, configure against the installed .pc file, build the module interfaces there.
check "install into a temporary prefix" meson install -C "$build" --destdir "$work/dest" --no-rebuild
pc=$(dirname "$(find "$work/dest" -name shardckpt.pc | head -1)")
lib=$(dirname "$(find "$work/dest" -name 'libshardckpt.so' | head -1)")
check "configure the pkg-config consumer" env PKG_CONFIG_PATH="$pc" \
  meson setup "$work/pkgconfig" "$root/examples/pkgconfig" --native-file "$root/scripts/clang.ini"
check "build the pkg-config consumer" meson compile -C "$work/pkgconfig"
check "run the pkg-config consumer" env LD_LIBRARY_PATH="$lib" "$work/pkgconfig/save_and_reshard" "$work/consumer.h5"
check "load --verify a consumer's checkpoint" "$exe" load "$work/consumer.h5" --tp 2 --gtp 3 --align 8 --verify
check "verify a consumer's checkpoint" "$exe" verify "$work/consumer.h5"
check "reshard a consumer's checkpoint" "$exe" reshard "$work/consumer.h5" "$work/consumer-re.h5" --tp 1 --gtp 1 --align 0
check "resharded tensors are equal" h5diff --exclude-path /_shardckpt "$work/consumer.h5" "$work/consumer-re.h5"
check "inspect a consumer's checkpoint" bash -c "'$exe' inspect '$work/consumer.h5' --json | /usr/bin/python3 -c \
  'import json, sys; d = json.load(sys.stdin); assert len(d[\"tensors\"]) == 10 and len(d[\"params\"]) == 2, d'"

# Subproject: the tutorial's project, with this repository at subprojects/shardckpt.
mkdir -p "$work/tutorial/subprojects"
cp "$root"/examples/subproject/* "$work/tutorial/"
ln -s "$root" "$work/tutorial/subprojects/shardckpt"
check "configure the tutorial" meson setup "$work/tutorial/build" "$work/tutorial" \
  --native-file "$work/tutorial/subprojects/shardckpt/scripts/clang.ini"
check "build the tutorial" meson compile -C "$work/tutorial/build"
check "run the tutorial" bash -c "cd '$work/tutorial' && build/tutorial"
check "h5py reads the tutorial's checkpoints" bash -c "cd '$work/tutorial' && /usr/bin/python3 read.py"
check "run the training loop (async saves from device memory, a restart in place)" \
  bash -c "cd '$work/tutorial' && build/training_loop"
check "load --verify the training loop's checkpoint" "$exe" load "$work/tutorial/training.h5" --tp 2 --gtp 1 --verify
check "verify the resharded tutorial checkpoint" "$exe" verify "$work/tutorial/resharded.h5"

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
check "make_v1.py makes a plain file a version 1 checkpoint" bash -c "
$py -c \"import h5py, numpy as np; h5py.File('$work/v1.h5', 'w')['w'] = np.arange(12, dtype=np.float32).reshape(6, 2)\" &&
$py '$h5/make_v1.py' '$work/v1.h5' && '$exe' inspect '$work/v1.h5' | grep -q 'format version 1'"

echo "consumers: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
