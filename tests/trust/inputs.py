"""Single-user checks of what the tool reads and must not trust: the plain file beside an adopted
checkpoint, an input renamed over while it is read, virtual datasets, small types with pad rows, and
the temporary files of saves."""
import os
import shutil
import signal
import subprocess
import threading

import h5py
import numpy as np
import xxhash

from tally import check
from trust.support import A, CFG, Z, demo, exe, expect, inspect_json, plain_in, raw_rows, temporaries, tool, \
    version1_metadata, work


def adopted_plain_file_replaced():
    """The plain file of an adopted checkpoint replaced by symbolic links, a FIFO and a link to /dev/zero."""
    d = os.path.join(work, "ext")
    os.mkdir(d)
    data = plain_in(d)
    ck = os.path.join(d, "ck.h5")
    expect(tool("adopt", data, "--model-config", CFG, "--out", ck), 0, "adopt for the external storage tests")
    expect(tool("load", ck, "--quiet"), 0, "the adopted checkpoint loads")
    real = os.path.join(d, "data.real")
    os.rename(data, real)
    elsewhere = os.path.join(work, "elsewhere")
    os.mkdir(elsewhere)
    shutil.copyfile(real, os.path.join(elsewhere, "data.h5"))  # the right bytes, but not beside the checkpoint
    shutil.copyfile(real, os.path.join(work, "x"))  # ../x from d
    replacements = {
        "a symbolic link to an absolute file": lambda: os.symlink(os.path.join(elsewhere, "data.h5"), data),
        "a relative symbolic link ../x": lambda: os.symlink("../x", data),
        "a FIFO": lambda: os.mkfifo(data),
        "a symbolic link to /dev/zero": lambda: os.symlink("/dev/zero", data),
    }
    out = os.path.join(d, "out.h5")
    for kind, make in replacements.items():
        make()
        for cmd in (["load", ck, "--quiet"], ["verify", ck], ["reshard", ck, out, "--quiet"]):
            what = f"{cmd[0]} with the plain file replaced by {kind}"
            # Timeout 20 s: a FIFO must not block the open, /dev/zero must not be read forever.
            r = tool(*cmd, timeout=20)
            if expect(r, 2, what):
                check("data.h5" in r.err, f"{what}: the error does not name the file: {r.err.strip()}")
            if cmd[0] == "reshard":
                check(not os.path.lexists(out) and temporaries(d, "out.h5") == [], f"{what}: an output was written")
        os.unlink(data)
        os.link(real, data)
        expect(tool("load", ck, "--quiet"), 0, f"load after {kind} was replaced by the real file again")
        os.unlink(data)
    os.rename(real, data)
    expect(tool("load", ck, "--verify", "--quiet"), 0, "load --verify with the real file back")


def version1_stored_externally():
    """Version 1 files made by h5py: external storage in an absolute path, and in a plain name that is a
    symbolic link. A control file with a regular external file loads."""
    v = os.path.join(work, "ext-v1")
    os.mkdir(v)
    absolute = "/etc/hostname" if os.path.isfile("/etc/hostname") and os.path.getsize("/etc/hostname") > 0 else "/etc/passwd"
    n = max(1, min(os.path.getsize(absolute), 64))
    with open(os.path.join(v, "ext.real"), "wb") as f:
        f.write(bytes(range(64)))
    os.symlink("ext.real", os.path.join(v, "ext.bin"))
    files = {"etc.h5": ((1, n), absolute), "link.h5": ((4, 16), "ext.bin"), "control.h5": ((4, 16), "ext.real")}
    for name, (shape, ext) in files.items():
        with h5py.File(os.path.join(v, name), "w") as f:
            f.create_dataset("w", shape=shape, dtype="u1", external=[(ext, 0, shape[0] * shape[1])])
            version1_metadata(f)
    for name, ext in [("etc.h5", absolute), ("link.h5", "ext.bin")]:
        for cmd in (["load", os.path.join(v, name), "--quiet"], ["reshard", os.path.join(v, name), os.path.join(v, "o.h5"), "--quiet"]):
            what = f"{cmd[0]} of a version 1 file stored externally in {ext}"
            r = tool(*cmd, timeout=20)
            if expect(r, 2, what):
                check(ext in r.err, f"{what}: the error does not name {ext}: {r.err.strip()}")
            check(not os.path.lexists(os.path.join(v, "o.h5")), f"{what}: an output was written")
    expect(tool("load", os.path.join(v, "control.h5"), "--quiet"), 0, "load of a version 1 file stored in a regular file beside it")


def external_storage():
    """5. The plain file beside an adopted checkpoint is opened as a regular file by its name only."""
    adopted_plain_file_replaced()
    version1_stored_externally()
    print("external storage: symbolic links, FIFOs and devices in place of the plain file are refused")


def race_inputs(d):
    """A, a demo checkpoint, and B, a copy of it with one id and other bytes: (a, b, row 0 of A, of B)."""
    a = os.path.join(d, "a.h5")
    b = os.path.join(d, "b.h5")
    expect(demo(a, "--layers", "1", "--mamba-layers", "0", "--cols", "64"), 0, "demo A for the race")
    # B: h5py's copy of A (no seal), same checkpoint id, iteration 2000, row 0 of z changed and its
    # checksum updated, so that B alone loads cleanly.
    with h5py.File(a, "r") as src, h5py.File(b, "w") as dst:
        for k in src:
            src.copy(src[k], dst, k)
    row_a = raw_rows(a, Z)[0].copy()
    with h5py.File(b, "r+") as f:
        f["_shardckpt/common"].attrs["iteration"] = np.int64(2000)
        ds = f[Z]
        width = ds.id.get_type().get_size()
        buf = np.empty(ds.shape, dtype={2: np.uint16, 4: np.uint32}[width])
        ds.id.read(h5py.h5s.ALL, h5py.h5s.ALL, buf, mtype=ds.id.get_type())
        flat = buf.reshape(buf.shape[0], -1)
        sums = f["_shardckpt/checksums"]
        slabs = np.asarray(f["_shardckpt/slabs"].attrs[Z]).reshape(-1, 5)
        understood = True
        for rb, re_, cb, ce, first in slabs:
            if rb <= 0 < re_:
                understood &= int(sums[first]) == xxhash.xxh3_64_intdigest(flat[0, cb:ce].astype("<u%d" % width).tobytes())
        check(understood, "the checksum of row 0 of A is xxh3-64 of its raw bytes (the test's reading of the format)")
        flat[0] = flat[0] ^ 0x0101  # other bits in every element of row 0
        ds.id.write(h5py.h5s.ALL, h5py.h5s.ALL, buf, mtype=ds.id.get_type())
        for rb, re_, cb, ce, first in slabs:
            if rb <= 0 < re_:
                sums[first] = np.uint64(xxhash.xxh3_64_intdigest(flat[0, cb:ce].astype("<u%d" % width).tobytes()))
    row_b = raw_rows(b, Z)[0].copy()
    check(not np.array_equal(row_a, row_b), "race: B's row 0 differs from A's")
    expect(tool("load", b, "--quiet"), 0, "B alone loads cleanly")
    ja, jb = inspect_json(a), inspect_json(b)
    check(ja is not None and jb is not None and ja["checkpoint_id"] == jb["checkpoint_id"]
          and ja["common"]["iteration"] == 1000 and jb["common"]["iteration"] == 2000,
          f"race: A and B share the checkpoint id and differ in iteration: {ja and ja.get('checkpoint_id')} "
          f"{jb and jb.get('checkpoint_id')}")
    return a, b, row_a, row_b


def race(d, a, b, row_a, row_b):
    """Reshards of a path that A and B are renamed over, again and again: (renames, outputs by kind)."""
    p = os.path.join(d, "p.h5")
    shutil.copyfile(a, p)
    stop = threading.Event()
    swaps = [0]

    def flipper():
        i = 0
        while not stop.is_set():
            src = (a, b)[i % 2]
            tmp = os.path.join(d, f"next{i % 2}.h5")
            shutil.copyfile(src, tmp)
            os.replace(tmp, p)
            i += 1
        swaps[0] = i

    t = threading.Thread(target=flipper, daemon=True)
    t.start()
    counts = {"A": 0, "B": 0, "exit 2": 0, "other exit": 0, "mixed": 0}
    try:
        for i in range(40):
            out = os.path.join(d, f"out{i}.h5")
            r = tool("reshard", p, out, "--tp", "1", "--gtp", "2", "--align", "4", "--quiet")
            if r.rc == 2:
                counts["exit 2"] += 1  # the input changed under it: refused, fine
                check(not os.path.lexists(out), f"race run {i}: exit 2 but an output was written")
                continue
            if r.rc != 0:
                counts["other exit"] += 1
                # Exit 1 would be a checksum mismatch: bytes of one file checked against the table of the other.
                check(False, f"race run {i}: reshard {r}")
                continue
            j = inspect_json(out)
            iteration = j["common"].get("iteration") if j else None
            row = raw_rows(out, Z)[0]
            by_iteration = {1000: "A", 2000: "B"}.get(iteration)
            by_row = "A" if np.array_equal(row, row_a) else "B" if np.array_equal(row, row_b) else None
            if by_iteration is None or by_iteration != by_row:
                counts["mixed"] += 1
                check(False, f"race run {i}: the output mixes checkpoints: iteration {iteration}, row 0 of {by_row}")
            else:
                counts[by_row] += 1
            os.unlink(out)
    finally:
        stop.set()
        t.join()
    return swaps, counts


def reshard_never_mixes():
    """7. A path renamed over again and again by two checkpoints with one id: every output is one of them."""
    d = os.path.join(work, "race")
    os.mkdir(d)
    a, b, row_a, row_b = race_inputs(d)
    swaps, counts = race(d, a, b, row_a, row_b)
    print(f"reshard race: {swaps[0]} renames over the input; outputs of A {counts['A']}, of B {counts['B']}, "
          f"exit 2 {counts['exit 2']}, other exits {counts['other exit']}, mixed {counts['mixed']}")


def virtual_datasets():
    """8. A virtual dataset (its bytes in other files, or fill values) is refused by name."""
    d = os.path.join(work, "virtual")
    os.mkdir(d)
    with h5py.File(os.path.join(d, "src.h5"), "w") as f:
        f["w"] = np.arange(40, dtype=np.float32).reshape(10, 4)
    layout = h5py.VirtualLayout(shape=(10, 4), dtype=np.float32)
    layout[...] = h5py.VirtualSource("src.h5", "w", shape=(10, 4))
    v = os.path.join(d, "v.h5")
    with h5py.File(v, "w") as f:
        f.create_virtual_dataset("virtual.weight", layout)
        version1_metadata(f)
    out = os.path.join(d, "out.h5")
    for cmd in (["load", v, "--quiet"], ["reshard", v, out, "--quiet"], ["verify", v]):
        r = tool(*cmd, timeout=20)
        what = f"{cmd[0]} of a virtual dataset"
        if expect(r, 2, what):
            check("virtual.weight" in r.err and "virtual" in r.err.replace("virtual.weight", ""),
                  f"{what}: the error does not name the dataset and say virtual: {r.err.strip()}")
        check(not os.path.lexists(out) and temporaries(d, "out.h5") == [], f"{what}: an output was written")
    print("virtual datasets: refused")

def small_types_with_pad_rows():
    """11. load --verify of i8, u8, f16, bf16 and f32 tensors at a layout with pad rows."""
    d = os.path.join(work, "types")
    os.mkdir(d)
    v1 = os.path.join(d, "v1.h5")
    values = {"t.i8": np.arange(-20, 20, dtype=np.int8).reshape(10, 4),
              "t.u8": np.arange(200, 240, dtype=np.uint8).reshape(10, 4),
              "t.f16": (np.arange(40, dtype=np.float16) - 7).reshape(10, 4),
              "t.f32": np.arange(40, dtype=np.float32).reshape(10, 4) * 0.5}
    bf16_bits = (np.arange(40, dtype=np.uint16) + 0x3F80).reshape(10, 4)
    with h5py.File(A, "r") as src:
        bf16_type = src[Z].id.get_type()  # shardckpt's own bf16 type
        with h5py.File(v1, "w") as f:
            for k, val in values.items():
                f[k] = val
            ds = h5py.h5d.create(f.id, b"t.bf16", bf16_type, h5py.h5s.create_simple((10, 4)))
            ds.write(h5py.h5s.ALL, h5py.h5s.ALL, bf16_bits, mtype=bf16_type)
            version1_metadata(f)
    # 10 rows at GTP 2 and alignment 4: shards of 8 rows, 3 pad rows each, of every element size. A
    # version 1 file has no checksums and no demo pattern: --verify checks its pad rows and says there
    # was nothing else to verify against (exit 1, docs/cli.md), where it once failed on the dtype.
    layout = ["--tp", "1", "--gtp", "2", "--align", "4"]
    r = tool("load", v1, "--verify", *layout)
    expect(r, 1, "load --verify of a version 1 file of i8, u8, f16, bf16 and f32 tensors with pad rows")
    check("pad rows zero" in r.out and "read as" not in r.err and "nothing to verify against" in r.err,
          f"load --verify of small types checks the pad rows of every dtype: {r.out}{r.err}")
    # Adopted, the same tensors are checksummed: load --verify checks every byte and every pad row.
    plain = os.path.join(d, "plain.h5")
    shutil.copyfile(v1, plain)
    with h5py.File(plain, "r+") as f:
        del f["_shardckpt"]
    records = os.path.join(d, "records.json")
    with open(records, "w") as f:
        f.write("[]")
    adopted = os.path.join(d, "adopted.h5")
    if expect(tool("adopt", plain, "--model-config", records, "--out", adopted), 0, "adopt the small types"):
        r = tool("load", adopted, "--verify", *layout)
        expect(r, 0, "load --verify of adopted i8, u8, f16, bf16 and f32 tensors with pad rows")
    # The same tensors resharded (checksummed now) load with --verify, and keep every bit.
    re_ = os.path.join(d, "re.h5")
    if expect(tool("reshard", v1, re_, *layout, "--quiet"), 0, "reshard of the small types"):
        expect(tool("load", re_, "--verify", *layout, "--quiet"), 0, "load --verify of the resharded small types")
        with h5py.File(re_, "r") as f:
            for k, val in values.items():
                check(f[k].dtype == val.dtype and np.array_equal(f[k][()], val), f"reshard changed {k}")
        check(np.array_equal(raw_rows(re_, "t.bf16"), bf16_bits), "reshard changed t.bf16")
    print(f"small types with pad rows: load --verify exit {r.rc}")


def stale_temporary_files():
    """12. A save's temporary file, finished or not, is never taken for a checkpoint."""
    d = os.path.join(work, "stale")
    os.mkdir(d)
    finished = os.path.join(d, ".ckpt.h5.0123456789abcdef0123456789abcdef.partial")
    shutil.copyfile(A, finished)
    # An unfinished one: a save killed in its writing phase leaves it.
    unfinished = None
    k = os.path.join(d, "k.h5")
    for attempt in range(5):
        p = subprocess.Popen([exe, "demo", "--out", k, "--phases", "--quiet", "--cols", "1024"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in p.stderr:
            if line.strip() == "shardckpt: save phase: writing":
                p.send_signal(signal.SIGKILL)
                break
        p.kill()
        p.wait()
        p.stderr.close()
        left = temporaries(d, "k.h5")
        if left:
            unfinished = os.path.join(d, left[0])
            break
    how = "left by a killed save"
    if unfinished is None:  # it always finished first: make one as a killed save leaves it (not complete)
        how = "made with h5py (every save finished before it was killed)"
        unfinished = os.path.join(d, ".k.h5.fedcba9876543210fedcba9876543210.partial")
        shutil.copyfile(A, unfinished)
        with h5py.File(unfinished, "r+") as f:
            del f["_shardckpt"].attrs["complete"]
    for label, path in [("a finished", finished), ("an unfinished", unfinished)]:
        for cmd in (["inspect", path], ["verify", path], ["load", path, "--quiet"]):
            r = tool(*cmd)
            what = f"{cmd[0]} of {label} temporary file"
            if expect(r, 2, what):
                check("temporary file of a save that did not finish" in r.err, f"{what}: {r.err.strip()}")
    print(f"stale temporary files: refused by name (the unfinished one {how})")
