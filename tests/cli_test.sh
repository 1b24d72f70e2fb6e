#!/usr/bin/env bash
# End-to-end tests of the command-line tool: plan (exact JSON), bad arguments and their exit codes,
# demo, load of any checkpoint, verify, reshard, inspect, h5py reading the file, MPI jobs, and saves
# that cannot write (injected EIO, full disks, file-size limits, short writes) on both write paths.
# Usage: cli_test.sh path/to/shardckpt path/to/libfaulty_io.so
set -uo pipefail
exe=$1
faulty=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
passed=0 failed=0
ok() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }
check() { local what=$1; shift; if "$@"; then ok; else fail "$what"; fi; }
# temporary_files DIR NAME: the temporary files of saves of NAME left in DIR (.NAME.<32 hex>.partial).
temporary_files() { find "$1" -maxdepth 1 -name ".$2.*.partial" -printf '%f\n'; }
# expect_rc CODE WHAT COMMAND...: the command exits with CODE.
expect_rc() {
  local want=$1 what=$2; shift 2
  "$@" > "$dir/out" 2> "$dir/err"
  local rc=$?
  if [ "$rc" -eq "$want" ]; then ok; else fail "$what: exit $rc, not $want: $(head -c 600 "$dir/err")"; fi
}
py=/usr/bin/python3
small=(--layers 1 --mamba-layers 1 --cols 64)

# ---- plan: the spec's reference case, checked field by field ------------------------------------------
"$exe" plan --model gdp-in-proj --heads 4 --head-dim 5 --groups 2 --state 3 --householder 3 --cols 4 --tp 2 --gtp 2 \
  --align 16 --json > "$dir/plan.json" || fail "plan exits 0"
check "plan json" $py - "$dir/plan.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
assert p["param_rows"] == 60 and p["shard_rows"] == 32 and p["pad_rows"] == 4, p
assert [(r["tp_rank"], r["gtp_rank"]) for r in p["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
r0 = p["ranks"][0]
assert [x["key"] for x in r0["pieces"]] == ["in_proj.weight.z", "in_proj.weight.V0", "in_proj.weight.V1", "in_proj.weight.V2"]
v2 = r0["pieces"][3]
assert v2 == {"key": "in_proj.weight.V2", "global_shape": [20, 4], "global_offset": [0, 0], "rows": 2, "shard_row": 30}, v2
r3 = p["ranks"][3]
assert r3["real_rows"] == 28 and not r3["padding_only"]
assert r3["pieces"][0] == {"key": "in_proj.weight.V2", "global_shape": [20, 4], "global_offset": [12, 0], "rows": 8, "shard_row": 0}
PY
"$exe" plan --model plain --rows 61760 --cols 10240 --tp 1 --gtp 64 --align 32 --json > "$dir/seed.json" || fail "seed plan"
check "seed plan" $py -c "
import json; p = json.load(open('$dir/seed.json')); r = p['ranks']
assert p['shard_rows'] == 992 and p['pad_rows'] == 1728
assert r[62]['real_rows'] == 256 and r[63]['padding_only'] and r[63]['pieces'] == [] and r[0]['real_rows'] == 992
assert sum(x['padding_only'] for x in r) == 1"
"$exe" plan --model mamba-in-proj --heads 4 --head-dim 4 --groups 2 --state 8 --cols 8 --tp 2 --gtp 3 --align 4 \
  | grep -q "padding-only ranks" || fail "plan table"

# ---- bad arguments: exit 2 and one line naming the reason; nothing overflows or hangs -----------------
for args in "--model gdp-in-proj --heads 3 --head-dim 4 --groups 2 --state 4 --cols 4 --tp 2 --gtp 2 --align 0" \
            "--model plain --rows 10 --cols 4 --tp 1 --gtp 4 --align 0" \
            "--model nonsense --cols 4" \
            "--model plain --rows 4 --tp 1 --gtp 1 --align 0" \
            "--model plain --rows 10 --cols 4 --gtp 2 --align 4611686018427387904" \
            "--model plain --rows 10 --cols 4 --tp 65536 --gtp 65536" \
            "--model plain --rows 9223372036854775807 --cols 4" \
            "--model plain --rows 9223372036854775808 --cols 4" \
            "--model plain --rows 1000 --cols 9223372036854775807 --tp 4 --gtp 4 --align 1073741824"; do
  expect_rc 2 "plan $args" "$exe" plan $args
  check "one-line reason for plan $args" test "$(wc -l < "$dir/err")" -eq 1
done
grep -q "does not divide by TP 2" <("$exe" plan --model gdp-in-proj --heads 3 --head-dim 4 --groups 2 --state 4 --cols 4 --tp 2 --gtp 2 --align 0 2>&1) || fail "reason names heads/TP"
expect_rc 2 "demo --householder 100000000" timeout 20 "$exe" demo --out "$dir/x.h5" --householder 100000000
expect_rc 2 "demo --tp 65536" timeout 20 "$exe" demo --out "$dir/x.h5" --tp 65536 --gtp 65536
expect_rc 2 "demo --align INT64_MAX" timeout 20 "$exe" demo --out "$dir/x.h5" --align 9223372036854775807
expect_rc 2 "unknown command" "$exe" frobnicate
check "unknown command is named" grep -q "unknown command 'frobnicate'" "$dir/err"
expect_rc 0 "--version" "$exe" --version
check "version names the format" grep -q "checkpoint format 2" "$dir/out"
expect_rc 0 "plan --help" "$exe" plan --help
check "help shows defaults" grep -q -- "--align INT.*=0" "$dir/out"
check "help shows descriptions" grep -q "GTP alignment in rows" "$dir/out"
for cmd in demo load verify reshard inspect; do
  expect_rc 0 "$cmd --help" "$exe" "$cmd" --help
  check "$cmd --help documents --json" grep -q -- "--json" "$dir/out"
done

# ---- demo: saves, reloads at another layout, verifies ----------------------------------------------------
check "demo" "$exe" demo --out "$dir/demo.h5" --json > "$dir/demo.json"
check "demo report" $py -c "
import json; d = json.load(open('$dir/demo.json'))
assert d['mismatches'] == 0 and d['values_verified'] > 0 and d['pad_rows_skipped'] > 0 and d['materializations'] == 0, d
assert d['save_layout'] != d['load_layout'] and d['checksums'] and d['verified']"
# Thread ranks up to the tool's maximum stay bounded in memory: at 1,024 ranks (DP 256) the process
# holds at most 256 KiB a rank beside the model's shards (it held 600 KiB a rank, and 2.2 MiB a rank at
# 2,048, when every rank of a replica group got every other's row counts). Not under ASan, whose
# runtime has memory of its own.
if grep -q __asan_init "$exe"; then
  echo "SKIP: demo --ranks 1024 memory (a sanitized build)"
else
  check "demo --ranks 1024" "$exe" demo --out "$dir/wide.h5" --ranks 1024 --json > "$dir/wide.json"
  check "demo --ranks 1024 memory per rank" $py -c "
import json; d = json.load(open('$dir/wide.json'))
extra = (d['peak_rss_bytes'] - d['shard_bytes']) / 1024
assert d['mismatches'] == 0 and extra <= 256 * 1024, f'{extra / 1024:.0f} KiB a rank beside the shards'"
  rm -f "$dir/wide.h5"
fi
check "demo f32 hyperslab dp" "$exe" demo --out "$dir/f32.h5" --dtype f32 --tp 1 --gtp 3 --align 8 --ranks 6 --method hyperslab > /dev/null
check "demo without checksums" "$exe" demo --out "$dir/nosum.h5" --no-checksums "${small[@]}" > /dev/null
# Shards in memory the library moves through a copy engine, saved in the background; Adam's state
# sharded by a distributed optimizer, reloaded at another DP, TP, GTP and alignment.
check "demo emulated async adam" "$exe" demo --out "$dir/adam.h5" "${small[@]}" --device emulated --async \
  --optimizer adam --distributed-optimizer --tp 2 --gtp 2 --align 16 --dp 2 --load-tp 1 --load-dp 3 --json > "$dir/adam.json"
check "demo adam report" $py -c "
import json; d = json.load(open('$dir/adam.json'))
assert d['mismatches'] == 0 and d['verified'] and d['async'] and d['device'] == 'emulated', d
assert d['distributed_optimizer'] and d['staging_bytes'] > 0 and 0 < d['blocking_seconds'] <= d['save_seconds'], d
assert d['load_layout']['dp'] == 3 and d['load_layout']['tp'] == 1 and d['materializations'] == 0, d"
check "adam state under Megatron's keys" $py -c "
import h5py; f = h5py.File('$dir/adam.h5', 'r')
for name in ('exp_avg', 'exp_avg_sq', 'fp32_param'):
    d = f['optimizer.state.' + name + '.decoder.layers.0.mixer.in_proj.weight.z']
    assert d.dtype == 'float32' and d.shape == f['decoder.layers.0.mixer.in_proj.weight.z'].shape, d"
check "demo pinned" "$exe" demo --out "$dir/pinned.h5" "${small[@]}" --device pinned --optimizer adam > /dev/null
expect_rc 2 "--distributed-optimizer needs adam" "$exe" demo --out "$dir/x.h5" --distributed-optimizer
expect_rc 2 "--device nonsense" "$exe" demo --out "$dir/x.h5" --device tpu
if ! nvidia-smi -L > /dev/null 2>&1; then
  expect_rc 2 "--device cuda without a GPU" "$exe" demo --out "$dir/x.h5" "${small[@]}" --device cuda
  check "says there is no CUDA device" grep -q "no CUDA device\|no CUDA support\|CUDA" "$dir/err"
fi

# ---- load: any checkpoint, planned from its own records ---------------------------------------------------
check "load verify" "$exe" load "$dir/demo.h5" --tp 1 --gtp 5 --align 4 --verify > /dev/null
check "load verify tp4 json" "$exe" load "$dir/demo.h5" --tp 4 --gtp 1 --align 0 --verify --json > "$dir/load.json"
check "load distributed optimizer at dp 4" "$exe" load "$dir/adam.h5" --tp 2 --gtp 1 --dp 4 --distributed-optimizer \
  --verify --device emulated > /dev/null
check "load adam state whole at dp 1" "$exe" load "$dir/adam.h5" --tp 1 --gtp 3 --align 4 --verify > /dev/null
# Tensor data read around the page cache arrives the same; where the file system refuses direct
# reads (EINVAL) it is read plainly instead; a direct read that fails is a load that fails.
check "load around the page cache" "$exe" load "$dir/demo.h5" --tp 1 --gtp 5 --align 4 --verify --bypass-page-cache > /dev/null
check "load where direct reads are refused" env LD_PRELOAD="$faulty" FAULTY_IO_PATH=demo.h5 FAULTY_IO_DIRECT=EINVAL \
  "$exe" load "$dir/demo.h5" --tp 2 --gtp 3 --align 4 --verify --bypass-page-cache > /dev/null
expect_rc 2 "load where a direct read fails" env LD_PRELOAD="$faulty" FAULTY_IO_PATH=demo.h5 FAULTY_IO_DIRECT=EIO \
  "$exe" load "$dir/demo.h5" --tp 2 --gtp 3 --align 4 --bypass-page-cache
check "the read error names the file" grep -q "could not read .* bytes at byte .*demo.h5: Input/output error" "$dir/err"
check "load json says what was checked" $py -c "
import json; d = json.load(open('$dir/load.json'))
assert d['verified'] and d['checksums_checked'] and d['pattern_checked'] and d['values_verified'] > 511232, d"
# A value changed behind the library's back: the checksum catches it (exit 1, key and rows named);
# without checksums the pattern still does; `verified` is the outcome.
cp "$dir/demo.h5" "$dir/tampered.h5"
$py -c "
import h5py; f = h5py.File('$dir/tampered.h5', 'r+'); f['decoder.layers.0.mixer.in_proj.weight.z'][3, 3] = -1.0" \
  || fail "tamper"
expect_rc 1 "load of a tampered file" "$exe" load "$dir/tampered.h5"
check "the mismatch names key and rows" grep -q "key decoder.layers.0.mixer.in_proj.weight.z.*rows \[3, 4)" "$dir/err"
expect_rc 1 "load --verify --no-checksums of a tampered file" "$exe" load "$dir/tampered.h5" --verify --no-checksums --json
check "verified is false on a mismatch" $py -c "
import json; d = json.load(open('$dir/out')); assert d['verified'] is False and d['mismatches'] > 0, d"
check "a demo file without checksums verifies by its pattern" "$exe" load "$dir/nosum.h5" --verify > /dev/null
# A file of another tool, adopted as format version 1 (docs/format.md): no checksums, no pattern.
$py - "$dir/v1.h5" <<'PY' || fail "write a version 1 file"
import h5py, numpy as np, sys
with h5py.File(sys.argv[1], "w") as f:
    f["w"] = np.arange(40, dtype=np.float32).reshape(10, 4)
    m = f.create_group("_shardckpt")
    m.create_group("common")
    m.attrs["format"] = np.bytes_("shardckpt")
    m.attrs["format_version"] = np.int64(1)
    m.attrs["kind"] = np.bytes_("global")
    m.attrs["params"] = np.bytes_("[]")
    m.attrs["complete"] = np.int64(1)
PY
expect_rc 0 "load a version 1 file" "$exe" load "$dir/v1.h5" --tp 1 --gtp 2 --align 4
check "one-line notice for a file without checksums" test "$(grep -c "notice: .*written before checksums existed" "$dir/err")" -eq 1
expect_rc 1 "load --verify of a file with nothing to verify against" "$exe" load "$dir/v1.h5" --verify
check "nothing to verify against" grep -q "nothing to verify against" "$dir/err"

# ---- a TP that does not divide the model's heads or groups: refused everywhere, with one message ---------------
# The demo's records know its 8 heads and 4 groups. TP 8 divides the rows of every block, and loaded
# before records had divisors; TP 3 divides neither heads nor rows, and is refused for the heads.
refused() {  # refused MESSAGE WHAT COMMAND...: exit 2 and exactly that one line on standard error
  local message=$1 what=$2; shift 2
  expect_rc 2 "$what" "$@"
  check "$what says '$message'" test "$(cat "$dir/err")" = "shardckpt: error: $message"
}
conv=decoder.layers.0.mixer.conv1d.weight
refused "$conv: heads (8) does not divide by TP 3" "load --tp 3" "$exe" -q load "$dir/demo.h5" --tp 3
refused "$conv: groups (4) does not divide by TP 8" "load --tp 8" "$exe" -q load "$dir/demo.h5" --tp 8 --gtp 1
refused "$conv: heads (8) does not divide by TP 3" "reshard --tp 3" "$exe" -q reshard "$dir/demo.h5" "$dir/x.h5" --tp 3
check "no output from a refused reshard at TP 3" test ! -e "$dir/x.h5"
refused "in_proj.weight: heads (8) does not divide by TP 3" "plan --tp 3" "$exe" plan --cols 4 --tp 3
refused "in_proj.weight: groups (4) does not divide by TP 8" "plan --tp 8" "$exe" plan --model mamba-conv1d --cols 4 --tp 8
refused "decoder.layers.0.mixer.in_proj.weight: heads (8) does not divide by TP 3" "demo --tp 3" \
  "$exe" -q demo --out "$dir/x.h5" --tp 3 --gtp 1
refused "decoder.layers.0.mixer.in_proj.weight: heads (8) does not divide by TP 3" "demo --load-tp 3" \
  "$exe" -q demo --out "$dir/x.h5" --load-tp 3
check "a demo that cannot reload saves nothing" test ! -e "$dir/x.h5"
check "inspect shows the divisors" bash -c "'$exe' inspect '$dir/demo.h5' | grep -q 'in_proj.weight (TP rows): z=128 .* a=8;  TP must divide heads=8 groups=4'"
# A checkpoint written before records had divisors (the fuzz corpus) loads as it did.
check "load a checkpoint without divisors" "$exe" load "$(dirname "$0")/fuzz/corpus/demo-bf16.h5" --tp 2 --gtp 1 --verify > /dev/null

# ---- verify: every byte of any checkpoint -------------------------------------------------------------------
expect_rc 0 "verify" "$exe" verify "$dir/demo.h5"
expect_rc 1 "verify a tampered file" "$exe" verify "$dir/tampered.h5" --json
check "verify names the row" $py -c "
import json; d = json.load(open('$dir/out'))
assert d['mismatches'] == 1 and not d['verified'] and 'rows [3, 4)' in d['problems'][0], d"
expect_rc 1 "verify a file without checksums" "$exe" verify "$dir/nosum.h5"
expect_rc 1 "verify a version 1 file" "$exe" verify "$dir/v1.h5"

# ---- reshard: every tensor of OUT equals IN's; damaged input is refused --------------------------------------
check "reshard" "$exe" reshard "$dir/demo.h5" "$dir/re.h5" --tp 1 --gtp 3 --align 8 --json > "$dir/re.json"
check "reshard json" $py -c "import json; d = json.load(open('$dir/re.json')); assert d['tensors'] == 42 and d['checksums_checked'], d"
check "h5diff after reshard" h5diff --exclude-path /_shardckpt "$dir/demo.h5" "$dir/re.h5"
check "load resharded" "$exe" load "$dir/re.h5" --tp 2 --gtp 4 --align 2 --verify > /dev/null
expect_rc 1 "reshard a tampered file" "$exe" reshard "$dir/tampered.h5" "$dir/bad.h5"
check "no output from a refused reshard" test ! -e "$dir/bad.h5" -a -z "$(temporary_files "$dir" bad.h5)"

# Objects of other tools at the root (a dataset without a value, a group) are skipped by name, not fatal.
cp "$dir/demo.h5" "$dir/foreign.h5"
$py -c "
import h5py; f = h5py.File('$dir/foreign.h5', 'r+'); f.create_dataset('empty', data=h5py.Empty('f'))
f.create_group('extra')" || fail "add foreign objects"
check "reshard skips a dataset without a value" "$exe" reshard "$dir/foreign.h5" "$dir/foreign-re.h5" --tp 1 --gtp 1 --align 0
check "inspect names what it skips" bash -c "'$exe' inspect '$dir/foreign.h5' | grep -q 'empty .*skipped: a dataset without a value (a null dataspace)'"

# ---- inspect ---------------------------------------------------------------------------------------------------
check "inspect json" $py -c "
import json, subprocess
d = json.loads(subprocess.check_output(['$exe', 'inspect', '$dir/demo.h5', '--json']))
keys = {t['key'] for t in d['tensors']}
assert 'decoder.layers.0.mixer.in_proj.weight.z' in keys and 'decoder.layers.2.mixer.in_proj.weight.dt' in keys, keys
p = {x['key']: x for x in d['params']}
assert [b['name'] for b in p['decoder.layers.0.mixer.in_proj.weight']['blocks']][:3] == ['z', 'V0', 'V1']
assert d['common']['iteration'] == 1000 and d['bytes'] == sum(t['bytes'] for t in d['tensors'])
assert d['format_version'] == 2 and d['checksummed'] and len(d['checkpoint_id']) == 32"
"$exe" inspect "$dir/demo.h5" | grep -q "fused layouts" || fail "inspect table"

# ---- h5py sees plain tensors with the pattern values: element i of key k is (fnv1a32(k) + i) mod 2^24 --------
check "h5py pattern" $py - "$dir/demo.h5" <<'PY'
import h5py, numpy as np, sys
def fnv(s):
    h = 2166136261
    for b in s.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h
def bf16(x):
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32)
f = h5py.File(sys.argv[1], "r")
n = 0
for k, d in f.items():
    if not isinstance(d, h5py.Dataset):
        continue
    want = bf16(((fnv(k) + np.arange(d.size, dtype=np.uint64)) % (1 << 24)).astype(np.float32))
    assert d.dtype == np.float32 and np.array_equal(d[()].reshape(-1), want), k
    n += 1
assert n > 30
PY

# ---- a save to a symbolic link replaces the link's target ---------------------------------------------------------
mkdir -p "$dir/real"
ln -s real/target.h5 "$dir/link.h5"
check "save through a link" "$exe" demo --out "$dir/link.h5" "${small[@]}" > /dev/null
check "the link stays a link" test -L "$dir/link.h5"
check "its target is the checkpoint" "$exe" verify "$dir/real/target.h5" > /dev/null

# ---- saves that cannot write fail, keep the earlier checkpoint, leave no partial file ----------------------------
# save_fails WHAT PATH COMMAND...: the command fails (exit 2) and PATH is byte for byte as before.
save_fails() {
  local what=$1 path=$2; shift 2
  local before
  before=$(md5sum < "$path")
  expect_rc 2 "$what" "$@"
  check "$what: the error is an I/O error" grep -q "could not" "$dir/err"
  check "$what: earlier checkpoint unchanged" test "$(md5sum < "$path")" = "$before"
  check "$what: no temporary file" test -z "$(temporary_files "$(dirname "$path")" "$(basename "$path")")"
}
cp "$dir/demo.h5" "$dir/keep.h5"
for method in raw hyperslab; do
  for after in 0 200000 600000; do  # while creating the file, writing pieces, writing checksums
    save_fails "EIO after $after bytes ($method)" "$dir/keep.h5" env LD_PRELOAD="$faulty" FAULTY_IO_PATH=.keep.h5. \
      FAULTY_IO_ERRNO=EIO FAULTY_IO_AFTER=$after "$exe" demo --out "$dir/keep.h5" --method $method
  done
  save_fails "ENOSPC ($method)" "$dir/keep.h5" env LD_PRELOAD="$faulty" FAULTY_IO_PATH=.keep.h5. \
    FAULTY_IO_ERRNO=ENOSPC FAULTY_IO_AFTER=300000 "$exe" demo --out "$dir/keep.h5" --method $method
  save_fails "fsync EIO ($method)" "$dir/keep.h5" env LD_PRELOAD="$faulty" FAULTY_IO_PATH=.keep.h5. \
    FAULTY_IO_FSYNC=EIO "$exe" demo --out "$dir/keep.h5" --method $method
  save_fails "ulimit -f ($method)" "$dir/keep.h5" bash -c "ulimit -f 600; exec \"\$0\" \"\$@\"" "$exe" demo \
    --out "$dir/keep.h5" --method $method
  # Short writes are no error: every byte still arrives, and the file verifies.
  check "short writes ($method)" env LD_PRELOAD="$faulty" FAULTY_IO_PATH=short.h5 FAULTY_IO_SHORT=1 \
    "$exe" demo --out "$dir/short.h5" --method $method > /dev/null
  check "short writes verify ($method)" "$exe" verify "$dir/short.h5" > /dev/null
done
if [ "$(id -u)" -eq 0 ] && mkdir -p "$dir/fs" && mount -t tmpfs -o size=512k tmpfs "$dir/fs" 2> /dev/null; then
  check "small save on a small tmpfs" "$exe" demo --out "$dir/fs/c.h5" --layers 1 --mamba-layers 0 --cols 16 > /dev/null
  for method in raw hyperslab; do
    save_fails "full tmpfs ($method)" "$dir/fs/c.h5" "$exe" demo --out "$dir/fs/c.h5" --method $method
  done
  fs_mounted=1
fi

# ---- the progress line: on a terminal only, silenced by --quiet -------------------------------------------------
if command -v script > /dev/null; then
  SHARDCKPT_PROGRESS_AFTER_MS=0 script -qec "$exe demo --out $dir/p.h5" /dev/null > "$dir/tty" 2>&1
  check "progress line on a terminal" grep -q "saving .* GB/s .* s left" "$dir/tty"
  SHARDCKPT_PROGRESS_AFTER_MS=0 script -qec "$exe --quiet demo --out $dir/p.h5" /dev/null > "$dir/tty" 2>&1
  check "no progress line with --quiet" bash -c "! grep -q 'GB/s .* s left' '$dir/tty'"
  SHARDCKPT_PROGRESS_AFTER_MS=0 "$exe" demo --out "$dir/p.h5" > /dev/null 2> "$dir/err"
  check "no progress line off a terminal" test ! -s "$dir/err"
fi

# ---- --mpi: four processes of one MPI job ------------------------------------------------------------------------------
if command -v mpirun > /dev/null; then
  # OpenMPI keeps allocations until exit: not ours to report under LeakSanitizer. mpirun itself runs
  # without meson's MALLOC_PERTURB_ (its PMIx server crashes on it when several ranks abort at once);
  # the ranks keep it.
  mpi=(env -u MALLOC_PERTURB_ ASAN_OPTIONS=detect_leaks=0 mpirun -np 4 --oversubscribe)
  [ -n "${MALLOC_PERTURB_:-}" ] && mpi+=(-x "MALLOC_PERTURB_=$MALLOC_PERTURB_")
  [ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
  check "mpi demo" "${mpi[@]}" "$exe" demo --mpi --out "$dir/mpi.h5" --tp 2 --gtp 2 --align 8 --json > "$dir/mpi.json"
  check "mpi demo totals" $py -c "
import json; d = json.load(open('$dir/mpi.json'))
assert d['mismatches'] == 0 and d['pad_rows_skipped'] > 0 and d['values_verified'] == 511232, d"
  check "mpi load" "${mpi[@]}" "$exe" load --mpi "$dir/mpi.h5" --tp 1 --gtp 4 --align 2 --verify > /dev/null
  check "mpi and threads write the same tensors" h5diff --exclude-path /_shardckpt "$dir/mpi.h5" "$dir/demo.h5"
  check "mpi async distributed optimizer" "${mpi[@]}" "$exe" demo --mpi --out "$dir/madam.h5" "${small[@]}" --async \
    --optimizer adam --distributed-optimizer --tp 1 --gtp 2 --dp 2 --load-tp 2 --load-gtp 1 > /dev/null
  check "mpi load dp 4" "${mpi[@]}" "$exe" load --mpi "$dir/madam.h5" --tp 1 --gtp 1 --dp 4 --distributed-optimizer \
    --verify > /dev/null
  cp "$dir/mpi.h5" "$dir/mkeep.h5"
  for method in raw hyperslab; do
    save_fails "mpi EIO ($method)" "$dir/mkeep.h5" "${mpi[@]}" -x LD_PRELOAD="$faulty" -x FAULTY_IO_PATH=.mkeep.h5. \
      -x FAULTY_IO_ERRNO=EIO -x FAULTY_IO_AFTER=40000 "$exe" demo --mpi --out "$dir/mkeep.h5" --method $method
    # 8 MB: room for Open MPI's shared memory, not for a 15.5 MiB checkpoint.
    save_fails "mpi ulimit -f ($method)" "$dir/mkeep.h5" "${mpi[@]}" bash -c "ulimit -f 8000; exec \"\$0\" \"\$@\"" \
      "$exe" demo --mpi --out "$dir/mkeep.h5" --method $method --cols 4096
  done
  if [ -n "${fs_mounted:-}" ]; then
    "${mpi[@]}" "$exe" demo --mpi --out "$dir/fs/m.h5" --layers 1 --mamba-layers 0 --cols 16 > /dev/null || fail "mpi small save"
    save_fails "mpi full tmpfs" "$dir/fs/m.h5" "${mpi[@]}" "$exe" demo --mpi --out "$dir/fs/m.h5"
  fi
fi
[ -n "${fs_mounted:-}" ] && umount "$dir/fs"

# ---- adopt: a plain h5py file becomes loadable; its data is not rewritten ---------------------------------------
mkdir -p "$dir/adopt"
"$exe" demo --out "$dir/adopt/f32.h5" --dtype f32 "${small[@]}" > /dev/null || fail "f32 demo for adopt"
$py - "$dir/adopt" <<'PY' || fail "plain files for adopt"
import h5py, json, sys
d = sys.argv[1]
src = h5py.File(d + '/f32.h5', 'r')
with h5py.File(d + '/plain.h5', 'w') as f:
    for k in src:
        if not k.startswith('_'):
            f.create_dataset(k, data=src[k][...])
json.dump(json.loads(src['_shardckpt/common'].attrs['model_config']), open(d + '/demo.json', 'w'))
params = src['_shardckpt'].attrs['params']
open(d + '/records.json', 'w').write(params.decode() if isinstance(params, bytes) else str(params))
with h5py.File(d + '/chunked.h5', 'w') as f:
    f.create_dataset('w', data=src['decoder.layers.0.norm.weight'][...], chunks=(16,))
PY
before=$(md5sum < "$dir/adopt/plain.h5")
check "adopt with the demo config" "$exe" adopt "$dir/adopt/plain.h5" --model-config "$dir/adopt/demo.json" > /dev/null
check "the plain file is unchanged" test "$(md5sum < "$dir/adopt/plain.h5")" = "$before"
check "adopted loads and verifies at another layout" "$exe" load "$dir/adopt/plain.shardckpt.h5" --tp 2 --gtp 3 \
  --align 8 --verify > /dev/null
check "adopted verifies" "$exe" verify "$dir/adopt/plain.shardckpt.h5" > /dev/null
check "adopt with parameter records" "$exe" adopt "$dir/adopt/plain.h5" --model-config "$dir/adopt/records.json" \
  --out "$dir/adopt/by-records.h5" --json > "$dir/adopt.json"
check "adopt json" $py -c "
import json; d = json.load(open('$dir/adopt.json')); assert d['params'] == 8 and d['tensors'] == 26, d"
check "h5py reads an adopted file beside its data" env HDF5_EXTFILE_PREFIX='${ORIGIN}' $py -c "
import h5py; a = h5py.File('$dir/adopt/by-records.h5', 'r'); b = h5py.File('$dir/adopt/f32.h5', 'r')
k = 'decoder.layers.0.mixer.in_proj.weight.z'; assert (a[k][...] == b[k][...]).all()"
# The reader opens the external file itself, beside the checkpoint: HDF5's prefix variable plays no part.
expect_rc 0 "an adopted file under another HDF5_EXTFILE_PREFIX" env HDF5_EXTFILE_PREFIX=/tmp "$exe" load \
  "$dir/adopt/by-records.h5"
expect_rc 2 "adopt a chunked dataset" "$exe" adopt "$dir/adopt/chunked.h5" --model-config "$dir/adopt/records.json"
check "says to store it contiguously" grep -q "not stored contiguously" "$dir/err"
expect_rc 2 "adopt a checkpoint" "$exe" adopt "$dir/adopt/f32.h5" --model-config "$dir/adopt/records.json" --out "$dir/adopt/x.h5"
expect_rc 2 "adopt elsewhere" "$exe" adopt "$dir/adopt/plain.h5" --model-config "$dir/adopt/demo.json" --out "$dir/x.h5"
$py -c "
import h5py; f = h5py.File('$dir/adopt/plain.h5', 'r+'); f['decoder.layers.0.mixer.in_proj.weight.z'][5, 7] = -3" || fail "tamper"
expect_rc 1 "a changed value of an adopted file" "$exe" load "$dir/adopt/plain.shardckpt.h5"
check "names the rows" grep -q "in_proj.weight.z.*rows \[5, 6)" "$dir/err"
# A file whose dataset points at a file outside its directory is refused before anything is read.
$py - "$dir/adopt" <<'PY' || fail "hostile external file"
import h5py, sys
d = sys.argv[1]
src = h5py.File(d + '/by-records.h5', 'r')
with h5py.File(d + '/outside.h5', 'w') as f:
    src.copy(src['_shardckpt'], f, '_shardckpt')
    for k in src:
        if not k.startswith('_'):
            f.create_dataset(k, shape=src[k].shape, dtype=src[k].dtype, external=[('/etc/hostname', 0, src[k].nbytes)])
PY
expect_rc 2 "a dataset in /etc/hostname" "$exe" load "$dir/adopt/outside.h5" --no-checksums
check "names the external file" grep -q "keeps its bytes in '/etc/hostname', not a plain file beside the checkpoint" "$dir/err"

# ---- adopt: scalar datasets (0-d tensors) are tensors of global shape [], inspected, loaded, resharded --------
$py - "$dir/adopt" <<'PY' || fail "a plain file with scalars"
import h5py, json, numpy as np, sys
with h5py.File(sys.argv[1] + '/scalars.h5', 'w') as f:
    f['step'] = np.float32(0.5)
    f['bn.num_batches_tracked'] = np.int64(3)
    f['w'] = np.arange(8, dtype=np.float32).reshape(4, 2)
json.dump([], open(sys.argv[1] + '/none.json', 'w'))
PY
check "adopt scalars" "$exe" adopt "$dir/adopt/scalars.h5" --model-config "$dir/adopt/none.json" > /dev/null
check "inspect: a scalar's global shape is []" bash -c "'$exe' inspect '$dir/adopt/scalars.shardckpt.h5' --json | $py -c \"
import json, sys; d = {t['key']: t for t in json.load(sys.stdin)['tensors']}
assert d['step']['global_shape'] == [] and d['step']['bytes'] == 4 and d['bn.num_batches_tracked']['dtype'] == 'i64', d
assert d['w']['global_shape'] == [4, 2], d\""
check "inspect table shows []" bash -c "'$exe' inspect '$dir/adopt/scalars.shardckpt.h5' | grep -q '^  step .* f32 *\[\] '"
check "scalars verify" "$exe" verify "$dir/adopt/scalars.shardckpt.h5" > /dev/null
check "scalars load at TP 2 x GTP 2 x DP 2" "$exe" load "$dir/adopt/scalars.shardckpt.h5" --tp 2 --gtp 2 --dp 2 > /dev/null
for m in raw hyperslab; do
  check "scalars load ($m)" "$exe" load "$dir/adopt/scalars.shardckpt.h5" --method $m > /dev/null
done
check "reshard scalars (one of the ranks writes each)" "$exe" reshard "$dir/adopt/scalars.shardckpt.h5" \
  "$dir/adopt/scalars-re.h5" --tp 2 --gtp 2 --align 0
check "h5py reads resharded scalars as shape ()" $py -c "
import h5py; f = h5py.File('$dir/adopt/scalars-re.h5', 'r')
assert f['step'].shape == () and f['step'][()] == 0.5 and f['bn.num_batches_tracked'][()] == 3, dict(f)
assert f['w'].shape == (4, 2)"
check "resharded scalars verify" "$exe" verify "$dir/adopt/scalars-re.h5" > /dev/null

# ---- adopt: a fused tensor (the blocks' rows one after another, as at TP 1) becomes its blocks ---------------
$py - "$dir/adopt" <<'PY' || fail "fused files for adopt"
import h5py, json, numpy as np, sys
d = sys.argv[1]
src = h5py.File(d + '/f32.h5', 'r')
records = json.load(open(d + '/records.json'))
fused = {r['key']: r for r in records if len(r['blocks']) > 1}
blocks = {r['key'] + '.' + b['name'] for r in fused.values() for b in r['blocks']}
def write(name, extra=None, rows_off=0):
    with h5py.File(d + '/' + name, 'w') as f:
        for k in src:
            if not k.startswith('_') and k not in blocks:
                f.create_dataset(k, data=src[k][...])
        for key, r in fused.items():
            whole = np.concatenate([src[key + '.' + b['name']][...] for b in r['blocks']])
            f.create_dataset(key, data=whole[rows_off:])
        if extra:
            f.create_dataset(extra, data=src[extra][...])
write('fused.h5')
write('both.h5', extra='decoder.layers.0.mixer.in_proj.weight.z')  # the fused tensor and one of its blocks
write('short.h5', rows_off=1)  # one row fewer than the blocks add up to
PY
check "adopt fused tensors" "$exe" adopt "$dir/adopt/fused.h5" --model-config "$dir/adopt/demo.json" --json \
  > "$dir/fused.json"
check "fused tensors counted" $py -c "
import json; d = json.load(open('$dir/fused.json')); assert d['fused'] == 4 and d['tensors'] == 26, d"
check "fused: load --verify against the demo pattern at another layout" "$exe" load "$dir/adopt/fused.shardckpt.h5" \
  --tp 2 --gtp 3 --align 8 --verify
check "fused: verify" "$exe" verify "$dir/adopt/fused.shardckpt.h5"
check "fused: each block points at its rows of the fused tensor, nothing copied" $py - "$dir/adopt" <<'PY'
import h5py, os, sys
d = sys.argv[1]
a = h5py.File(d + '/fused.shardckpt.h5', 'r'); p = h5py.File(d + '/fused.h5', 'r'); s = h5py.File(d + '/f32.h5', 'r')
k = 'decoder.layers.0.mixer.in_proj.weight'
base = p[k].id.get_offset(); row = p[k].dtype.itemsize * p[k].shape[1]
first = 0
for name in ['z', 'V0', 'V1', 'K0', 'K1', 'Q', 'b0', 'b1', 'a']:
    ext = a[k + '.' + name].external
    assert ext == [('fused.h5', base + first * row, s[k + '.' + name].nbytes)], (name, ext)
    first += s[k + '.' + name].shape[0]
assert first == p[k].shape[0]
assert os.path.getsize(d + '/fused.shardckpt.h5') < os.path.getsize(d + '/fused.h5') / 4
PY
check "fused: reshard writes the blocks the plain save wrote" "$exe" reshard "$dir/adopt/fused.shardckpt.h5" \
  "$dir/adopt/fused-re.h5" --tp 1 --gtp 2 --align 0
check "fused: resharded values equal the demo's" $py -c "
import h5py; a = h5py.File('$dir/adopt/fused-re.h5', 'r'); b = h5py.File('$dir/adopt/f32.h5', 'r')
keys = [k for k in b if not k.startswith('_')]
assert sorted(keys) == sorted(k for k in a if not k.startswith('_'))
assert all((a[k][...] == b[k][...]).all() for k in keys)"
expect_rc 2 "adopt a fused tensor beside one of its blocks" "$exe" adopt "$dir/adopt/both.h5" --model-config "$dir/adopt/demo.json"
check "says one or the other" grep -q "in_proj.weight.z of one of its blocks: adopt takes one or the other" "$dir/err"
expect_rc 2 "adopt a fused tensor of the wrong rows" "$exe" adopt "$dir/adopt/short.h5" --model-config "$dir/adopt/demo.json"
check "names the shapes" grep -q "says the fused tensor has shape \[600, 64\] (its blocks one after another) but decoder.layers.0.mixer.in_proj.weight has \[599, 64\]" "$dir/err"

# ---- adopt --common: typed common values, seen by inspect and returned by load ---------------------------------
check "adopt with common values" "$exe" adopt "$dir/adopt/plain.h5" --model-config "$dir/adopt/records.json" \
  --out "$dir/adopt/common.h5" --common step=1200 --common lr=3e-4 --common warmup=-0.5 --common run=exp-7 \
  --common 'tag="42"' --common empty= > /dev/null
"$exe" inspect "$dir/adopt/common.h5" --json > "$dir/inspect-common.json" || fail "inspect the common values"
"$exe" load "$dir/adopt/common.h5" --tp 2 --gtp 2 --align 8 --json > "$dir/load-common.json" || fail "load the common values"
for j in inspect-common load-common; do
  check "$j: typed common values" $py -c "
import json; c = json.load(open('$dir/$j.json'))['common']
want = {'step': 1200, 'lr': 3e-4, 'warmup': -0.5, 'run': 'exp-7', 'tag': '42', 'empty': ''}
assert c == want and type(c['step']) is int and type(c['lr']) is float and type(c['tag']) is str, c"
done
check "inspect prints them" grep -q 'step = 1200' <("$exe" inspect "$dir/adopt/common.h5")
for bad in "novalue|not key=value" "=5|not key=value" "_x=1|key '_x' cannot name a common value" \
           "n=99999999999999999999|the integer is outside the int64 range" "x=1e999|outside the range of a double" \
           "model_config=1|the demo model config sets it"; do
  expect_rc 2 "--common ${bad%%|*}" "$exe" adopt "$dir/adopt/plain.h5" --model-config "$dir/adopt/demo.json" \
    --out "$dir/adopt/bad-common.h5" --common "${bad%%|*}"
  check "--common ${bad%%|*}: says why, in one line" test "$(wc -l < "$dir/err")" -eq 1 -a -n "$(grep -F "${bad#*|}" "$dir/err")"
done
expect_rc 2 "--common given twice" "$exe" adopt "$dir/adopt/plain.h5" --model-config "$dir/adopt/records.json" \
  --out "$dir/adopt/bad-common.h5" --common a=1 --common a=2
check "says twice" grep -q "\-\-common a is given twice" "$dir/err"
check "no checkpoint from bad common values" test ! -e "$dir/adopt/bad-common.h5"

# ---- errors: not a checkpoint, missing file -----------------------------------------------------------------------
echo "hello" > "$dir/text.h5"
expect_rc 2 "inspect a text file" "$exe" inspect "$dir/text.h5"
check "says not a checkpoint" grep -q "not a shardckpt checkpoint" "$dir/err"
expect_rc 2 "load a missing file" "$exe" load "$dir/missing.h5" --verify

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
