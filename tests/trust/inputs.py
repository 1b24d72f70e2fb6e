"""Single-user checks of what the tool reads and must not trust: the plain file beside an adopted
checkpoint, an input renamed over while it is read, virtual datasets, small types with pad rows, and
the temporary files of saves."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import xxhash

from tally import check
from trust.support import A, CFG, Z, demo, exe, expect, inspect_json, one_error_line, plain_in, raw_rows, run, \
    temporaries, tool, version1_metadata, work


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


class BlockedWriter:
    """A process blocked in open(FIFO, O_WRONLY), as a program that writes into a FIFO waits for its reader.
    Any open of the FIFO for reading (even O_NONBLOCK, even closed at once) releases it: a command that
    opens the FIFO before it refuses it hands the writer a reader that is gone."""

    def __init__(self, fifo):
        self.p = subprocess.Popen([sys.executable, "-c", "import os, sys; os.open(sys.argv[1], os.O_WRONLY)", fifo],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Wait until it is inside the open (x86-64 openat is 257, open 2): a reader that came first would
        # not release it, and the check would pass without meaning anything.
        deadline = time.time() + 10
        self.blocked_in_open = False
        while time.time() < deadline and self.p.poll() is None:
            try:
                with open(f"/proc/{self.p.pid}/syscall") as f:
                    if f.read().split(" ", 1)[0] in ("257", "2"):
                        self.blocked_in_open = True
                        break
            except OSError:
                pass
            time.sleep(0.01)
        if not self.blocked_in_open:  # no /proc/PID/syscall here: give it time to get there
            time.sleep(1)

    def released(self):
        try:
            self.p.wait(timeout=0.3)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self):
        self.p.kill()
        self.p.wait()


def meets_fifo(fifo, cmd, what, rc=2, says=None):
    """Runs one command that meets FIFO with a writer blocked on it: it must not open it (the writer stays
    blocked), nor hang, and it ends with exit `rc` (an error naming `says`, for rc 2)."""
    w = BlockedWriter(fifo)
    try:
        r = tool(*cmd, timeout=20)
        released = w.released()
    finally:
        w.stop()
    check(not released, f"{what}: the FIFO was opened (a writer blocked on it was released)")
    if expect(r, rc, what) and says is not None:
        check(says in r.err, f"{what}: the error does not say {says!r}: {r.err.strip()}")
    return w.blocked_in_open


def fifos_never_opened():
    """4. A FIFO where a command expects a regular file is looked at, not opened: a writer blocked on it
    stays blocked after every command that meets it (the external file of an adopted checkpoint, a
    version 1 file's external storage, the checkpoint itself, adopt's input and every output)."""
    d = os.path.join(work, "fifo")
    os.mkdir(d)
    data = plain_in(d)
    ck = os.path.join(d, "ck.h5")
    expect(tool("adopt", data, "--model-config", CFG, "--out", ck), 0, "adopt for the FIFO tests")
    real = os.path.join(d, "data.real")
    os.rename(data, real)
    os.mkfifo(data)
    out = os.path.join(d, "out.h5")
    kind = "is a FIFO, not a regular file"
    waited = []
    for cmd in (["load", ck, "--quiet"], ["verify", ck], ["reshard", ck, out, "--quiet"],
                ["load", ck, "--quiet", "--method", "hyperslab"]):
        waited.append(meets_fifo(data, cmd, f"{cmd[0]} of an adopted checkpoint whose plain file is a FIFO", 2, kind))
        check(not os.path.lexists(out) and temporaries(d, "out.h5") == [], f"{cmd[0]}: an output was written")
    # inspect reads no tensor bytes: it need not look at the plain file at all, and must not open it.
    r_inspect = meets_fifo(data, ["inspect", ck], "inspect of an adopted checkpoint whose plain file is a FIFO", 0)
    waited.append(r_inspect)
    # adopt of a FIFO in the input's place.
    waited.append(meets_fifo(data, ["adopt", data, "--model-config", CFG, "--out", os.path.join(d, "a2.h5")],
                             "adopt of a FIFO", 2, kind))
    # The checkpoint itself a FIFO.
    fck = os.path.join(d, "fifo.h5")
    os.mkfifo(fck)
    for cmd in (["load", fck, "--quiet"], ["verify", fck], ["inspect", fck], ["reshard", fck, out, "--quiet"]):
        waited.append(meets_fifo(fck, cmd, f"{cmd[0]} of a checkpoint that is a FIFO", 2, kind))
    # Outputs that are FIFOs are refused by what their name is, never opened.
    for cmd in (["reshard", A, fck, "--quiet"], ["demo", "--out", fck, "--quiet"] + ["--layers", "1", "--mamba-layers", "0", "--cols", "16"],
                ["adopt", real, "--model-config", CFG, "--out", fck]):
        waited.append(meets_fifo(fck, cmd, f"{cmd[0]} to a FIFO", 2, "a FIFO"))
    # A version 1 file (h5py) whose external storage is a FIFO beside it.
    v1 = os.path.join(d, "v1.h5")
    ext = os.path.join(d, "ext.bin")
    os.mkfifo(ext)
    with h5py.File(v1, "w") as f:
        f.create_dataset("w", shape=(4, 16), dtype="u1", external=[("ext.bin", 0, 64)])
        version1_metadata(f)
    for cmd in (["load", v1, "--quiet"], ["reshard", v1, out, "--quiet"]):
        waited.append(meets_fifo(ext, cmd, f"{cmd[0]} of a version 1 file stored externally in a FIFO", 2, kind))
    os.unlink(data)
    os.rename(real, data)
    expect(tool("load", ck, "--verify", "--quiet"), 0, "load --verify with the real file back")
    how = "inside open() (/proc/PID/syscall)" if all(waited) else "for 1 s (no /proc/PID/syscall)"
    print(f"FIFOs: {len(waited)} commands met a FIFO with a writer blocked {how} on it")


def extfile_prefix_ignored():
    """3. HDF5_EXTFILE_PREFIX (absolute, or ${ORIGIN}/../elsewhere) naming a directory that holds another
    file of the plain file's name: load, verify, reshard and inspect read the checkpoint's own file beside
    it. HDF5 1.10 resolves external storage against the variable before any property list, so the
    library reads external storage itself and never through HDF5."""
    top = os.path.join(work, "prefix")
    d = os.path.join(top, "ck")
    elsewhere = os.path.join(top, "elsewhere")
    os.makedirs(d)
    os.mkdir(elsewhere)
    data = plain_in(d)
    ck = os.path.join(d, "ck.h5")
    expect(tool("adopt", data, "--model-config", CFG, "--out", ck), 0, "adopt for the HDF5_EXTFILE_PREFIX tests")
    other = plain_in(elsewhere)  # the same layout and offsets, other values
    with h5py.File(other, "r+") as f:
        for k in f:
            f[k][...] = f[k][...] + 1
    with h5py.File(data, "r") as f:
        want = {k: f[k][...] for k in f}
    # A version 1 file of h5py's whose external storage is ext.bin, beside it and (other bytes) elsewhere.
    v1 = os.path.join(d, "v1.h5")
    for where, fill in [(d, 0), (elsewhere, 100)]:
        with open(os.path.join(where, "ext.bin"), "wb") as f:
            f.write(bytes(fill + i for i in range(64)))
    with h5py.File(v1, "w") as f:
        f.create_dataset("w", shape=(4, 16), dtype="u1", external=[("ext.bin", 0, 64)])
        version1_metadata(f)
    out = os.path.join(d, "out.h5")
    saved = os.environ.get("HDF5_EXTFILE_PREFIX")
    try:
        for prefix in (elsewhere, "${ORIGIN}/../elsewhere"):
            os.environ["HDF5_EXTFILE_PREFIX"] = prefix
            where = f"with HDF5_EXTFILE_PREFIX={prefix}"
            # The premise: HDF5 itself (h5py, in a process started with the variable: HDF5 reads it once,
            # when it starts) reads the other file.
            r = run([sys.executable, "-c", "import sys, h5py; print(h5py.File(sys.argv[1], 'r')[sys.argv[2]][0, 0])",
                     ck, Z])
            # (${ORIGIN} is the checkpoint's directory to h5py: ck/../elsewhere.)
            check(r.rc == 0 and r.out.strip() == str(float(want[Z][0, 0]) + 1), f"h5py {where} reads the other file: {r} {r.out}")
            for cmd in (["load", ck, "--verify", "--quiet"], ["load", ck, "--verify", "--quiet", "--method", "hyperslab"],
                        ["verify", ck], ["inspect", ck]):
                expect(tool(*cmd, timeout=60), 0, f"{' '.join(cmd[:1] + cmd[3:])} of an adopted checkpoint {where}")
            if expect(tool("reshard", ck, out, "--quiet"), 0, f"reshard of an adopted checkpoint {where}"):
                with h5py.File(out, "r") as f:
                    same = all(np.array_equal(f[k][...], v) for k, v in want.items())
                check(same, f"reshard of an adopted checkpoint {where}: the output holds other values than the file beside it")
                os.unlink(out)
            if expect(tool("reshard", v1, out, "--quiet"), 0, f"reshard of a version 1 file stored externally {where}"):
                with h5py.File(out, "r") as f:
                    got = f["w"][...].tobytes()
                check(got == bytes(range(64)), f"reshard of a version 1 file {where} read {got[:4]!r}..., not the ext.bin beside it")
                os.unlink(out)
    finally:
        if saved is None:
            os.environ.pop("HDF5_EXTFILE_PREFIX", None)
        else:
            os.environ["HDF5_EXTFILE_PREFIX"] = saved
    print("HDF5_EXTFILE_PREFIX: absolute and ${ORIGIN}-relative prefixes play no part")


def adopt_drops_nothing():
    """2. adopt of an h5py file takes every dataset it holds or refuses it: an external link, a soft link
    (to a dataset, or dangling), a group, a named datatype and a dataset stored in another file at the
    root are each refused naming the link, where it points and the file; no checkpoint is written."""
    d = os.path.join(work, "links")
    os.mkdir(d)
    with h5py.File(os.path.join(d, "sibling.h5"), "w") as f:
        f["x"] = np.arange(8, dtype=np.float32)
    with open(os.path.join(d, "ext.bin"), "wb") as f:
        f.write(bytes(32))
    records = os.path.join(d, "records.json")
    with open(records, "w") as f:
        f.write("[]")
    cases = {
        "an external link": (lambda f: f.__setitem__("x", h5py.ExternalLink("sibling.h5", "/x")),
                             ["x is an external link to '/x' in the file 'sibling.h5'", "follows no link"]),
        "a soft link to a dataset": (lambda f: f.__setitem__("x", h5py.SoftLink("/y")), ["x is a soft link to '/y'"]),
        "a dangling soft link": (lambda f: f.__setitem__("x", h5py.SoftLink("/nowhere")), ["x is a soft link to '/nowhere'"]),
        "a group": (lambda f: f.create_group("g").create_dataset("inner", data=np.arange(4, dtype=np.float32)),
                    ["g is a group", "not those in groups"]),
        "a named datatype": (lambda f: f.__setitem__("t", np.dtype("<f4")), ["t is a named datatype"]),
        "external storage": (lambda f: f.create_dataset("x", shape=(8,), dtype="<f4", external=[("ext.bin", 0, 32)]),
                             ["x keeps its bytes in other files"]),
    }
    for i, (kind, (make, says)) in enumerate(cases.items()):
        for order in (False, True):  # names indexed, and names in creation order as well
            src = os.path.join(d, f"in{i}{'t' if order else ''}.h5")
            with h5py.File(src, "w", track_order=order) as f:
                f["y"] = np.arange(16, dtype=np.float32)
                make(f)
            out = os.path.join(d, f"out{i}.h5")
            r = tool("adopt", src, "--model-config", records, "--out", out)
            what = f"adopt of a file holding {kind}" + (" (track_order)" if order else "")
            if expect(r, 2, what):
                check(one_error_line(r) and os.path.basename(src) in r.err and all(s in r.err for s in says),
                      f"{what}: the error does not name the file and say {says}: {r.err.strip()}")
            check(not os.path.lexists(out) and temporaries(d, os.path.basename(out)) == [], f"{what}: a checkpoint was written")
    # The control: the same file without them adopts, and the checkpoint holds every dataset of it.
    src = os.path.join(d, "plain.h5")
    with h5py.File(src, "w") as f:
        f["y"] = np.arange(16, dtype=np.float32)
        f["z"] = np.arange(6, dtype=np.int64).reshape(2, 3)
        f["alias"] = f["y"]  # a second hard link to y: a dataset of its own name
    out = os.path.join(d, "plain.shardckpt.h5")
    if expect(tool("adopt", src, "--model-config", records, "--out", out), 0, "adopt of a file of plain datasets"):
        j = inspect_json(out)
        keys = sorted(t["key"] for t in j["tensors"]) if j else None
        check(keys == ["alias", "y", "z"], f"the adopted checkpoint holds {keys}, not every dataset of the input")
    print(f"adopt: {len(cases)} kinds of object it cannot adopt refused by name, none dropped")


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
