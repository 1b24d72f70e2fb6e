"""What every group of trust checks shares: the command line, running the tool, reading its files,
and the inputs the checks start from.

Importing this module does what trust_test.py did before any check: it parses the command line
(`trust_test.py SHARDCKPT_EXE [--part single|shared]`), for the shared part makes sure it can run
(else exit 77), and makes a scratch directory `work` holding the demo checkpoint A and the plain
file PLAIN and model config CFG for adopt (two checks).
"""
import argparse
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile

import h5py
import numpy as np

from tally import check

parser = argparse.ArgumentParser()
parser.add_argument("exe")
parser.add_argument("--part", choices=["single", "shared"], default="single")
args = parser.parse_args()
exe = os.path.abspath(args.exe) if os.sep in args.exe else args.exe
SMALL = ["--layers", "1", "--mamba-layers", "0", "--cols", "16"]
SIGNATURE = b"\x89HDF\r\n\x1a\n"
Z = "decoder.layers.0.mixer.in_proj.weight.z"  # a tensor every demo model has
is_root = os.geteuid() == 0


def _sanitized(path):
    """Whether the tool was built with ASan: its runtime reserves terabytes of shadow address space
    (so no limit on address space lets it start) and needs descriptors of its own (UBSan's vptr check
    opens a pipe to probe memory, and reports a false error when it cannot)."""
    found = shutil.which(path) if os.sep not in path else path
    try:
        with open(found, "rb") as f:
            return b"__asan_init" in f.read()
    except (OSError, TypeError):
        return False


sanitized = _sanitized(exe)


class Result:
    def __init__(self, rc, out, err):
        self.rc, self.out, self.err = rc, out, err

    def __str__(self):
        return f"exit {self.rc}: {self.err.strip()[-800:]}"


def run(cmd, timeout=60, cwd=None, stdin=subprocess.DEVNULL):
    """Runs a command; a timeout is rc None (killed), a signal a negative rc."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, cwd=cwd,
                           stdin=stdin)
        return Result(p.returncode, p.stdout, p.stderr)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return Result(None, "", f"timed out after {timeout} s; stderr so far: {err}")


def tool(*a, timeout=60, cwd=None):
    return run([exe] + list(a), timeout=timeout, cwd=cwd)


def expect(res, want, what):
    check(res.rc == want, f"{what}: {res}, not exit {want}")
    return res.rc == want


def one_error_line(res):
    lines = [l for l in res.err.splitlines() if l.strip()]
    return len(lines) == 1 and lines[0].startswith("shardckpt: error: ")


def temporaries(d, name):
    """Temporary files of saves of NAME left in D: .NAME.<anything>.partial."""
    try:
        entries = os.listdir(d)
    except OSError:
        return []
    return [e for e in entries if (e.startswith("." + name + ".") and e.endswith(".partial"))]


def demo(out, *extra):
    return tool("demo", "--out", out, "--quiet", *(list(extra) or SMALL))


def inspect_json(path):
    r = tool("inspect", path, "--json")
    if r.rc != 0:
        return None
    try:
        return json.loads(r.out)
    except ValueError:
        return None


def remove_any(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def identity(path):
    """What a special file is: its type, inode and (for links) target."""
    st = os.lstat(path)
    link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    return (stat.S_IFMT(st.st_mode), st.st_ino, st.st_rdev, link)


def version1_metadata(f):
    """The _shardckpt group of a version 1 file of another tool (tests/cli_test.sh)."""
    m = f.create_group("_shardckpt")
    m.create_group("common")
    m.attrs["format"] = np.bytes_("shardckpt")
    m.attrs["format_version"] = np.int64(1)
    m.attrs["kind"] = np.bytes_("global")
    m.attrs["params"] = np.bytes_("[]")
    m.attrs["complete"] = np.int64(1)


def raw_rows(path, key):
    """The raw little-endian bits of a dataset (bf16 as uint16), read without conversion."""
    with h5py.File(path, "r") as f:
        d = f[key]
        width = d.id.get_type().get_size()
        buf = np.empty(d.shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])
        d.id.read(h5py.h5s.ALL, h5py.h5s.ALL, buf, mtype=d.id.get_type())
        return buf


def skip(why):
    print(f"trust shared: skipped: {why}")
    sys.exit(77)  # meson's "skipped"


def shared_prerequisites():
    """The two-user part needs root (to save as root), the user nobody (the attacker) and setpriv."""
    if not is_root:
        skip("needs root (it plants files as nobody and saves as root)")
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        skip("there is no user nobody")
    try:
        nogroup = grp.getgrnam("nogroup").gr_name
    except KeyError:
        try:
            nogroup = grp.getgrgid(nobody.pw_gid).gr_name
        except KeyError:
            skip("there is no group nogroup")
    setpriv = shutil.which("setpriv")
    if not setpriv:
        skip("setpriv is missing")
    as_nobody = [setpriv, "--reuid=nobody", f"--regid={nogroup}", "--clear-groups", "--"]
    probe = run(as_nobody + ["id", "-u"])
    if probe.rc != 0 or probe.out.strip() != str(nobody.pw_uid):
        skip(f"setpriv cannot run a command as nobody ({probe})")
    return nobody, as_nobody


attacker = shared_prerequisites() if args.part == "shared" else None
work = tempfile.mkdtemp(prefix="shardckpt-trust-")
A = os.path.join(work, "a.h5")


def make_adopt_inputs():
    """A plain h5py file with the demo model's datasets (f32) and the demo model config for adopt."""
    f32 = os.path.join(work, "f32.h5")
    r = demo(f32, "--dtype", "f32", *SMALL)
    expect(r, 0, "f32 demo for adopt")
    plain = os.path.join(work, "plain-template.h5")
    cfg = os.path.join(work, "demo.json")
    with h5py.File(f32, "r") as src, h5py.File(plain, "w") as f:
        for k in src:
            if not k.startswith("_"):
                f.create_dataset(k, data=src[k][...])
        json.dump(json.loads(src["_shardckpt/common"].attrs["model_config"]), open(cfg, "w"))
    return plain, cfg


def plain_in(d, name="data.h5"):
    p = os.path.join(d, name)
    shutil.copyfile(PLAIN, p)
    return p


expect(demo(A), 0, "demo for the tests")
PLAIN, CFG = make_adopt_inputs()
