#!/usr/bin/python3
"""Hostile files: a seeded generator damages and tampers with a real checkpoint in every way it
knows (truncations, byte flips in metadata and in data, attributes of the wrong type, shape or size,
every attribute tampered with by h5py, foreign and scalar datasets) and runs `load`, `inspect`,
`reshard` and `verify` on each file. Run against the ASan+UBSan build: no run may crash, hang or
report a sanitizer error, every one must end with exit 0, 1 or 2, and every flipped data byte must
be reported (exit 1) by verify, load and reshard.

Usage: hostile_test.py path/to/shardckpt [--files N] [--seed S]
Prints "hostile files: N passed, N failed" and exits non-zero on any failure.
"""
import argparse
import os
import random
import shutil
import subprocess
import tempfile

import h5py
import numpy as np

from tally import check, finish

parser = argparse.ArgumentParser()
parser.add_argument("exe")
parser.add_argument("--files", type=int, default=120)
parser.add_argument("--seed", type=int, default=20261130)
args = parser.parse_args()
rng = random.Random(args.seed)
exe = args.exe
work = tempfile.mkdtemp(prefix="shardckpt-hostile-")
base = os.path.join(work, "base.h5")
env = dict(os.environ)
env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":halt_on_error=1:detect_leaks=1"
env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"


def run(cmd, what):
    """Runs a command on a hostile file: it must end by itself, with 0, 1 or 2, sanitizers quiet."""
    try:
        # A tampered name may not be UTF-8, and the tool quotes it in its messages.
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, timeout=60)
    except subprocess.TimeoutExpired:
        check(False, f"{what}: hangs")
        return None
    clean = p.returncode in (0, 1, 2) and "Sanitizer" not in p.stderr and "runtime error" not in p.stderr
    check(clean, f"{what}: exit {p.returncode}: {p.stderr[-2000:]}")
    return p.returncode


def every_command(path, what):
    codes = {}
    codes["load"] = run([exe, "load", path, "--tp", "1", "--gtp", "3", "--align", "4", "--quiet"], what + ": load")
    codes["inspect"] = run([exe, "inspect", path], what + ": inspect")
    out = os.path.join(work, "out.h5")
    codes["reshard"] = run([exe, "reshard", path, out, "--tp", "2", "--gtp", "1", "--align", "0", "--quiet"],
                           what + ": reshard")
    if os.path.exists(out):
        os.remove(out)
    codes["verify"] = run([exe, "verify", path], what + ": verify")
    return codes


subprocess.run([exe, "demo", "--out", base, "--quiet", "--layers", "1", "--mamba-layers", "1", "--cols", "32"],
               check=True, env=env, stdout=subprocess.DEVNULL)
raw = open(base, "rb").read()

# Where the tensor data and the checksum table lie; every other byte is metadata.
with h5py.File(base, "r") as f:
    data = []
    for key, d in f.items():
        if isinstance(d, h5py.Dataset):
            if d.chunks is None:
                data.append((key, d.id.get_offset(), d.id.get_storage_size(), d.dtype.itemsize))
            else:
                for i in range(d.id.get_num_chunks()):
                    info = d.id.get_chunk_info(i)
                    data.append((key, info.byte_offset, info.size, d.dtype.itemsize))
    table = f["_shardckpt/checksums"]
    data.append(("_shardckpt/checksums", table.id.get_offset(), table.id.get_storage_size(), 8))
    attributes = [(name, k) for name in ("_shardckpt", "_shardckpt/common", "_shardckpt/slabs")
                  for k in f[name].attrs.keys()]
    keys = [k for k, d in f.items() if isinstance(d, h5py.Dataset)]
in_data = [False] * len(raw)
for _, offset, size, _ in data:
    for i in range(offset, offset + size):
        in_data[i] = True
metadata_bytes = [i for i in range(len(raw)) if not in_data[i]]


def write(path, content):
    with open(path, "wb") as out:
        out.write(content)


def random_value():
    kind = rng.choice(["int", "uint", "float", "string", "long string", "empty string", "vlen", "ints", "matrix",
                       "strings", "compound", "bool", "empty"])
    if kind == "int":
        return np.int64(rng.choice([0, 1, -1, 2, 3, 2**62, -2**63]))
    if kind == "uint":
        return np.uint64(rng.choice([0, 1, 2**63, 2**64 - 1]))
    if kind == "float":
        return np.float64(rng.choice([0.0, 1.0, 1e300, float("nan"), float("inf")]))
    if kind == "string":
        return np.bytes_(bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 40))))
    if kind == "long string":
        return np.bytes_(b"x" * rng.choice([70000, 300000]))
    if kind == "empty string":
        return h5py.Empty("S1")
    if kind == "vlen":
        return rng.choice(["global", "[]", "shardckpt", "{" * 50, ""])
    if kind == "ints":
        return np.arange(rng.choice([0, 1, 2, 8, 100000]), dtype=np.int64)
    if kind == "matrix":
        return np.ones((rng.randrange(1, 6), rng.randrange(1, 7)), dtype=rng.choice([np.int64, np.int8, np.float32]))
    if kind == "strings":
        return np.array([b"a", b"b", b"c", b"d"])
    if kind == "compound":
        return np.array([(1, 2.0)], dtype=[("a", "i8"), ("b", "f8")])[0]
    if kind == "bool":
        return np.bool_(True)
    return h5py.Empty("i8")


def tamper_attribute(path, group, name):
    with h5py.File(path, "r+") as f:
        attrs = f[group].attrs
        if rng.random() < 0.15:
            del attrs[name]
        else:
            value = random_value()
            del attrs[name]
            attrs[name] = value


def tamper_dataset(path):
    with h5py.File(path, "r+") as f:
        key = rng.choice(keys)
        choice = rng.choice(["dtype", "scalar", "delete", "rename", "foreign", "shape", "attr"])
        if choice == "dtype":
            values = f[key][()]
            del f[key]
            f[key] = values.astype(rng.choice([np.int8, np.float64, np.uint16, "S4"]))
        elif choice == "scalar":
            del f[key]
            f[key] = np.float32(1)
        elif choice == "delete":
            del f[key]
        elif choice == "rename":
            f.move(key, key + ".moved")
        elif choice == "foreign":
            f.create_group(rng.choice(["extra", "_other", "z"]))
            f["zz.scalar"] = 3
        elif choice == "shape":
            shape = f[key].shape
            del f[key]
            f[key] = np.zeros((shape[0] + 1,) + shape[1:], dtype=np.float32)
        else:
            f[key].attrs[rng.choice(["global_shape", "global_offset", "note"])] = random_value()
        return f"{choice} of {key}"


flips_reported = 0
kinds = ["truncate", "metadata flip", "data flip", "attribute", "dataset"]
# Seeded random files, then one per attribute of the file: every attribute is tampered with.
plan = [kinds[n % len(kinds)] for n in range(args.files)] + ["every attribute"] * len(attributes)
for n, kind in enumerate(plan):
    path = os.path.join(work, f"h{n}.h5")
    what = f"file {n} ({kind})"
    if kind == "truncate":
        cut = rng.randrange(0, len(raw))
        write(path, raw[:cut])
        what += f" at byte {cut}"
    elif kind == "metadata flip":
        at = rng.choice(metadata_bytes)
        content = bytearray(raw)
        content[at] ^= 1 << rng.randrange(8)
        write(path, bytes(content))
        what += f" at byte {at}"
    elif kind == "data flip":
        key, offset, size, itemsize = rng.choice([d for d in data if d[0] != "_shardckpt/checksums"])
        at = offset + rng.randrange(size)
        content = bytearray(raw)
        content[at] ^= 1 << rng.randrange(8)
        write(path, bytes(content))
        what += f" in {key} at byte {at}"
    elif kind == "attribute":
        write(path, raw)
        group, name = rng.choice(attributes)
        tamper_attribute(path, group, name)
        what += f" {group}/{name}"
    elif kind == "every attribute":
        write(path, raw)
        group, name = attributes[n - args.files]
        tamper_attribute(path, group, name)
        what += f" {group}/{name}"
    else:
        write(path, raw)
        what += " " + tamper_dataset(path)
    codes = every_command(path, what)
    if kind == "data flip":
        # A flipped bit in a tensor is always reported as a mismatch, by every command that reads it.
        check(codes["verify"] == 1, f"{what}: verify did not report the flip (exit {codes['verify']})")
        check(codes["load"] == 1, f"{what}: load did not report the flip (exit {codes['load']})")
        check(codes["reshard"] == 1, f"{what}: reshard did not report the flip (exit {codes['reshard']})")
        flips_reported += codes["verify"] == 1
    os.remove(path)

shutil.rmtree(work, ignore_errors=True)
print(f"hostile files: {len(plan)} files ({len(attributes)} attributes each tampered with), "
      f"{flips_reported} data flips, all reported")
finish("hostile files")
