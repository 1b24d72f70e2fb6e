"""Single-user checks of what stands where the tool expects a plain file: a FIFO (never opened, so a
writer blocked on it stays blocked), links and other objects in an adopt input (refused by name, never
dropped), and HDF5_EXTFILE_PREFIX pointing elsewhere (no part in what is read)."""
import os
import subprocess
import sys
import time

import h5py
import numpy as np

from tally import check
from trust.support import A, CFG, Z, demo, expect, inspect_json, one_error_line, plain_in, run, temporaries, \
    tool, version1_metadata, work


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


def checkpoint_links_refused():
    """4. A link at the root of a checkpoint (soft, external to a sibling file, external to an absolute
    path: h5py reads each as a dataset of the file) makes every command that takes the checkpoint whole
    refuse it, naming the link and where it points: a reshard that dropped it would exit 0 with an output
    that lacks a dataset h5py showed in the input."""
    d = os.path.join(work, "ckptlinks")
    os.mkdir(d)
    sibling = os.path.join(d, "sibling.h5")
    with h5py.File(sibling, "w") as f:
        f["x"] = np.arange(8, dtype=np.float32)
    cases = {
        "an external link to a sibling file": (h5py.ExternalLink("sibling.h5", "/x"), "an external link to '/x' in the file 'sibling.h5'"),
        "an external link to an absolute path": (h5py.ExternalLink(sibling, "/x"), f"an external link to '/x' in the file '{sibling}'"),
        "a soft link": (None, "a soft link to '/"),
    }
    for i, (kind, (link, says)) in enumerate(cases.items()):
        ck = os.path.join(d, f"ck{i}.h5")
        expect(demo(ck), 0, f"demo for {kind}")
        with h5py.File(ck, "r+") as f:
            if link is None:  # a soft link to one of the checkpoint's own datasets
                target = next(k for k in f if not k.startswith("_"))
                link, says = h5py.SoftLink("/" + target), f"a soft link to '/{target}'"
            f["linked"] = link
        with h5py.File(ck, "r") as f:  # the premise: h5py reads it as a dataset of the checkpoint
            check(isinstance(f["linked"], h5py.Dataset), f"h5py does not read {kind} as a dataset")
        out = os.path.join(d, f"out{i}.h5")
        for cmd in (["reshard", ck, out, "--tp", "1", "--gtp", "1", "--align", "0", "--quiet"], ["load", ck, "--quiet"],
                    ["verify", ck]):
            r = tool(*cmd)
            what = f"{cmd[0]} of a checkpoint holding {kind}"
            if expect(r, 2, what):
                check(one_error_line(r) and "linked is " + says in r.err and "follows no links" in r.err,
                      f"{what}: the error does not name the link and where it points: {r.err.strip()}")
            check(not os.path.lexists(out) and temporaries(d, os.path.basename(out)) == [], f"{what}: an output was written")
    print(f"checkpoint links: {len(cases)} kinds refused by reshard, load and verify, naming the link")
