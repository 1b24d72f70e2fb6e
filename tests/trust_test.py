#!/usr/bin/python3
"""Trust tests: what shardckpt does with names, files and limits it cannot trust.

Single-user part (default, `--part single`):
  - permissions: a new checkpoint gets 0666 less the umask; a replaced one keeps its mode and group;
  - only regular files are replaced: a FIFO, a socket, a directory, a link to a device or a
    character device at the output path is refused (exit 2) and left as it was; a link to a regular
    file has its target replaced;
  - adopt never replaces its own input (same name, a symbolic link to it, a hard link to it);
  - the plain file an adopted checkpoint points at is opened safely: a symbolic link (absolute or
    relative), a FIFO or a link to /dev/zero in its place is refused without hanging, and so is a
    version 1 file whose external storage is an absolute path or a symbolic link;
  - paths deeper than PATH_MAX (relative to a deep working directory) work;
  - reshard of a path renamed over, again and again, by two checkpoints that share one checkpoint
    id never writes a mix of the two (the common values of one, tensor bytes of the other);
  - virtual datasets are refused;
  - two saves to one path at once both succeed and leave one complete checkpoint;
  - closed standard streams never let a message land in the checkpoint;
  - load --verify of i8, u8, f16, bf16 and f32 tensors with pad rows;
  - the temporary file of a save (.NAME.<32 hex>.partial) is never read as a checkpoint;
  - resource limits (open files, address space, a load that cannot fit in memory) end in one error
    line, never in a crash.

Two-user part (`--part shared`, needs root, the user nobody and setpriv; else exit 77): in a
world-writable sticky directory `nobody` plants the old predictable temporary name ckpt.h5.partial
as a symbolic link to a file of root's, a dangling symbolic link into a root-only directory, a 0666
file of its own, and (made by root for it) a hard link to root's file; saves by root (demo, both
write methods, reshard, adopt) must neither write through nor touch what was planted.

Usage: trust_test.py path/to/shardckpt [--part single|shared]
Prints "trust: N passed, N failed" and exits non-zero on any failure (77: the part cannot run here).
"""
import argparse
import grp
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

import h5py
import numpy as np
import xxhash

from tally import check, finish

parser = argparse.ArgumentParser()
parser.add_argument("exe")
parser.add_argument("--part", choices=["single", "shared"], default="single")
args = parser.parse_args()
exe = os.path.abspath(args.exe) if os.sep in args.exe else args.exe
SMALL = ["--layers", "1", "--mamba-layers", "0", "--cols", "16"]
SIGNATURE = b"\x89HDF\r\n\x1a\n"
Z = "decoder.layers.0.mixer.in_proj.weight.z"  # a tensor every demo model has
is_root = os.geteuid() == 0


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


# ======================================================================================================
# Shared part: a save never writes through, nor touches, a name another user planted.
# ======================================================================================================
def shared_part(nobody, as_nobody):
    """1. nobody plants the old temporary name; root's saves neither write through it nor touch it."""
    shared = tempfile.mkdtemp(prefix="shardckpt-trust-shared-", dir="/tmp")
    os.chmod(shared, 0o1777)  # world-writable and sticky, as /tmp
    secret = tempfile.mkdtemp(prefix="shardckpt-trust-secret-", dir="/tmp")  # root's alone (0700)
    os.chmod(secret, 0o700)
    victim = os.path.join(secret, "victim")
    victim_bytes = b"root's file: a save must never write here\n"
    with open(victim, "wb") as f:
        f.write(victim_bytes)
    os.chmod(victim, 0o640)
    victim_st = os.stat(victim)
    dangling = os.path.join(secret, "created-by-a-save")
    ckpt = os.path.join(shared, "ckpt.h5")
    planted = os.path.join(shared, "ckpt.h5.partial")  # the name old versions wrote
    adopt_input = plain_in(shared, "data.h5")  # adopt's --out must be beside its input
    planted_bytes = b"nobody's file\n"
    commands = {
        "demo": [exe, "demo", "--out", ckpt, "--quiet"] + SMALL,
        "demo --method hyperslab": [exe, "demo", "--out", ckpt, "--quiet", "--method", "hyperslab"] + SMALL,
        "reshard": [exe, "reshard", A, ckpt, "--quiet"],
        "adopt": [exe, "adopt", adopt_input, "--model-config", CFG, "--out", ckpt],
    }

    def plant(kind):
        remove_any(planted)
        remove_any(ckpt)
        if kind == "symlink to root's file":
            r = run(as_nobody + ["ln", "-s", victim, planted])
        elif kind == "dangling symlink":
            r = run(as_nobody + ["ln", "-s", dangling, planted])
        elif kind == "0666 file of nobody's":
            r = run(as_nobody + ["/bin/sh", "-c", 'umask 0; printf "%s" "$2" > "$1"', "sh", planted,
                                 planted_bytes.decode()])
        else:  # hard link to root's file, made by root standing in for an attacker
            os.link(victim, planted)
            r = Result(0, "", "")
        check(r.rc == 0 and os.path.lexists(planted), f"plant a {kind}: {r}")
        st = os.lstat(planted)
        # The planted object, as the attacker left it: what each save must leave exactly so.
        return {"ino": st.st_ino, "uid": st.st_uid, "mode": st.st_mode,
                "link": os.readlink(planted) if stat.S_ISLNK(st.st_mode) else None,
                "bytes": open(planted, "rb").read() if stat.S_ISREG(st.st_mode) else None}

    for kind in ["symlink to root's file", "dangling symlink", "0666 file of nobody's", "hard link to root's file"]:
        before = plant(kind)
        if kind != "hard link to root's file":
            check(before["uid"] == nobody.pw_uid, f"{kind}: planted by nobody")
        if kind == "0666 file of nobody's":
            check(stat.S_IMODE(before["mode"]) == 0o666, f"{kind}: planted with mode 0666")
        for name, cmd in commands.items():
            what = f"shared dir, planted {kind}, {name}"
            r = run(cmd)
            # The save succeeds: the planted name is not in its way (it is not the name a save uses).
            expect(r, 0, what)
            # Root's file is neither written nor chmod-ed through a link; nothing is created in root's
            # directory through a dangling link.
            st = os.stat(victim)
            check(open(victim, "rb").read() == victim_bytes, f"{what}: root's file was written through the plant")
            check(stat.S_IMODE(st.st_mode) == 0o640 and st.st_uid == victim_st.st_uid,
                  f"{what}: root's file changed mode or owner: {oct(st.st_mode)} uid {st.st_uid}")
            check(not os.path.lexists(dangling), f"{what}: a file was created through the dangling link")
            # The planted object is still exactly what was planted (nothing removed, renamed, truncated).
            try:
                now = os.lstat(planted)
                same = (now.st_ino == before["ino"] and now.st_uid == before["uid"] and now.st_mode == before["mode"]
                        and (before["link"] is None or os.readlink(planted) == before["link"])
                        and (before["bytes"] is None or open(planted, "rb").read() == before["bytes"]))
            except FileNotFoundError:
                same = False
            check(same, f"{what}: the planted {planted} was changed or removed")
            # The checkpoint is root's own new regular file, not the planted inode, and it verifies.
            try:
                cst = os.lstat(ckpt)
                own = (stat.S_ISREG(cst.st_mode) and cst.st_uid == 0 and cst.st_ino != before["ino"]
                       and cst.st_ino != victim_st.st_ino)
            except FileNotFoundError:
                own = False
            check(own, f"{what}: {ckpt} is not a new regular file of root's")
            expect(tool("verify", ckpt), 0, f"{what}: verify")
            check(temporaries(shared, "ckpt.h5") == [], f"{what}: temporary files left: {temporaries(shared, 'ckpt.h5')}")
        print(f"shared: planted {kind}: every save went around it")
    remove_any(planted)

    # While a save writes, its temporary file is .ckpt.h5.<32 hex digits>.partial, mode 0600, root's
    # (an unpredictable name nobody can plant; unreadable by others until renamed). The save is
    # stopped (SIGSTOP) as its writing phase begins to look at it.
    pattern = re.compile(r"^\.ckpt\.h5\.[0-9a-f]{32}\.partial$")
    seen = None
    for attempt in range(4):
        p = subprocess.Popen([exe, "demo", "--out", ckpt, "--phases", "--quiet", "--cols", "1024"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            for line in p.stderr:
                if line.strip() == "shardckpt: save phase: writing":
                    p.send_signal(signal.SIGSTOP)
                    temps = temporaries(shared, "ckpt.h5")
                    if temps:
                        st = os.lstat(os.path.join(shared, temps[0]))
                        seen = (temps, stat.S_IMODE(st.st_mode), st.st_uid, stat.S_ISREG(st.st_mode))
                    p.send_signal(signal.SIGCONT)
                    break
            p.stderr.read()
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
            p.wait()
        if seen:
            break
    check(seen is not None, "a save's temporary file (.ckpt.h5.<32 hex>.partial) was never seen while it wrote")
    if seen:
        temps, mode, uid, regular = seen
        check(len(temps) == 1 and pattern.match(temps[0]), f"temporary file name {temps} is not .ckpt.h5.<32 hex>.partial")
        check(mode == 0o600 and uid == 0 and regular, f"temporary file {temps}: mode {oct(mode)}, uid {uid}, not 0600 root's")
        print(f"shared: a save writes {temps[0]} (mode {oct(mode)})")
    expect(tool("verify", ckpt), 0, "verify after the stopped save")
    shutil.rmtree(shared, ignore_errors=True)
    shutil.rmtree(secret, ignore_errors=True)


# ======================================================================================================
# Single-user part.
# ======================================================================================================
def umasked(mask, cmd):
    return ["bash", "-c", f'umask {mask:03o}; exec "$@"', "_"] + cmd


def save_cmd(which, out, d):
    if which == "demo":
        return [exe, "demo", "--out", out, "--quiet"] + SMALL
    if which == "reshard":
        return [exe, "reshard", A, out, "--quiet"]
    return [exe, "adopt", os.path.join(d, "data.h5"), "--model-config", CFG, "--out", out]


def permissions():
    """2. A new checkpoint is 0666 less the umask; a replaced one keeps its mode (and its group)."""
    daemon_gid = None
    if is_root:
        try:
            daemon_gid = grp.getgrnam("daemon").gr_gid
        except KeyError:
            pass
    for which in ["demo", "reshard", "adopt"]:
        d = os.path.join(work, "perm-" + which)
        os.mkdir(d)
        plain_in(d)
        for mask, want in [(0o022, 0o644), (0o077, 0o600)]:
            out = os.path.join(d, f"new-{mask:03o}.h5")
            r = run(umasked(mask, save_cmd(which, out, d)))
            if expect(r, 0, f"{which} under umask {mask:03o}"):
                mode = stat.S_IMODE(os.stat(out).st_mode)
                # Guards: the temporary file's 0600 must not stick to the checkpoint (0644 under 022),
                # nor may a save ignore the umask (0600 under 077).
                check(mode == want, f"{which}: a new checkpoint under umask {mask:03o} is {oct(mode)}, not {oct(want)}")
        # A replaced 0600 checkpoint stays 0600 under umask 022 (a private checkpoint is not opened up).
        out = os.path.join(d, "private.h5")
        shutil.copyfile(A, out)
        os.chmod(out, 0o600)
        if expect(run(umasked(0o022, save_cmd(which, out, d))), 0, f"{which} replacing a 0600 checkpoint"):
            mode = stat.S_IMODE(os.stat(out).st_mode)
            check(mode == 0o600, f"{which}: a replaced 0600 checkpoint became {oct(mode)}")
        # A replaced 0640 checkpoint of group daemon keeps mode and group (shared with a group).
        out = os.path.join(d, "group.h5")
        shutil.copyfile(A, out)
        os.chmod(out, 0o640)
        if daemon_gid is not None:
            os.chown(out, -1, daemon_gid)
        if expect(run(umasked(0o022, save_cmd(which, out, d))), 0, f"{which} replacing a 0640 checkpoint"):
            st = os.stat(out)
            check(stat.S_IMODE(st.st_mode) == 0o640, f"{which}: a replaced 0640 checkpoint became {oct(st.st_mode)}")
            if daemon_gid is not None:
                check(st.st_gid == daemon_gid, f"{which}: a replaced checkpoint of group daemon has group {st.st_gid}")
        check(all(temporaries(d, n) == [] for n in os.listdir(d)), f"{which}: temporary files left in {d}")
    print("permissions: new 0666 & ~umask, replaced keep mode" + (" and group" if daemon_gid is not None else
                                                                 " (group part skipped: not root)"))


def only_regular_files():
    """3. A save replaces only regular files: special files at the output are refused and left alone."""
    d = os.path.join(work, "special")
    os.mkdir(d)
    plain_in(d)
    null_before = os.stat("/dev/null")
    # The link points at a device (or, without root, a FIFO) of the test's own: never at /dev/null
    # itself, which a tool that replaces what it is given would destroy for the whole machine.
    link_target = os.path.join(d, "private-null")
    if is_root:
        os.mknod(link_target, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    else:
        os.mkfifo(link_target)
    kinds = ["fifo", "socket", "directory", "symlink to a device"] + (["character device"] if is_root else [])
    sockets = []
    for which in ["demo", "reshard", "adopt"]:
        for kind in kinds:
            out = os.path.join(d, f"{which}-{kind.replace(' ', '-').replace('/', '')}")
            if kind == "fifo":
                os.mkfifo(out)
            elif kind == "socket":
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind(out)
                sockets.append(s)
            elif kind == "directory":
                os.mkdir(out)
            elif kind == "symlink to a device":
                os.symlink(link_target, out)
            else:
                os.mknod(out, stat.S_IFCHR | 0o666, os.makedev(1, 3))
            before = identity(out)
            what = f"{which} to a {kind}"
            # A timeout counts: opening a FIFO to write must not wait for a reader.
            r = run(save_cmd(which, out, d), timeout=20)
            if expect(r, 2, what):
                # The path as given, or (for the link) the file it names, which is what is refused.
                named = os.path.basename(out) in r.err
                check(named, f"{what}: the error does not name the path: {r.err.strip()}")
            check(identity(out) == before, f"{what}: the {kind} was replaced or changed")
            if kind == "directory":
                check(os.listdir(out) == [], f"{what}: something was written into the directory")
            linked = os.stat(link_target)
            check(stat.S_ISCHR(linked.st_mode) if is_root else stat.S_ISFIFO(linked.st_mode),
                  f"{what}: the device a link points at was replaced")
            null = os.stat("/dev/null")
            check(stat.S_ISCHR(null.st_mode) and null.st_rdev == null_before.st_rdev and null.st_ino == null_before.st_ino,
                  f"{what}: /dev/null is no longer the character device")
            name = os.path.basename(out)
            check(temporaries(d, name) == [] and temporaries(d, "private-null") == [] and not os.path.lexists(out + ".partial"),
                  f"{what}: temporary files left: {temporaries(d, name) + temporaries(d, 'private-null')}")
        # A symbolic link to a regular file: its target is replaced, the link stays a link.
        target = os.path.join(d, f"{which}-target.h5")
        link = os.path.join(d, f"{which}-link.h5")
        shutil.copyfile(A, target)
        old = open(target, "rb").read()
        os.symlink(os.path.basename(target), link)
        what = f"{which} to a symbolic link to a regular file"
        if expect(run(save_cmd(which, link, d), timeout=60), 0, what):
            check(os.path.islink(link) and os.readlink(link) == os.path.basename(target), f"{what}: the link is gone")
            check(os.path.isfile(target) and not os.path.islink(target) and open(target, "rb").read() != old,
                  f"{what}: the target was not replaced")
            expect(tool("verify", target), 0, f"{what}: verify the target")
        check(temporaries(d, os.path.basename(target)) == [] and temporaries(d, os.path.basename(link)) == [],
              f"{what}: temporary files left")
    for s in sockets:
        s.close()
    print(f"regular files only: refused {', '.join(kinds)}; a link to a regular file has its target replaced")


def adopt_never_replaces_its_input():
    """4. adopt FILE --out FILE (by any name: the same, a symbolic link, a hard link) is refused."""
    d = os.path.join(work, "adopt-self")
    os.mkdir(d)
    data = plain_in(d)
    original = open(data, "rb").read()
    os.symlink("data.h5", os.path.join(d, "link.h5"))
    os.link(data, os.path.join(d, "hard.h5"))
    for what, out in [("the same name", data), ("another spelling", os.path.join(d, ".", "data.h5")),
                      ("a symbolic link to it", os.path.join(d, "link.h5")),
                      ("a hard link to it", os.path.join(d, "hard.h5"))]:
        r = tool("adopt", data, "--model-config", CFG, "--out", out)
        expect(r, 2, f"adopt with --out {what}")
        check(open(data, "rb").read() == original, f"adopt with --out {what}: the input was changed")
        check(not os.path.islink(data) and os.path.isfile(data), f"adopt with --out {what}: the input was replaced")
    check(os.path.islink(os.path.join(d, "link.h5")) and os.stat(os.path.join(d, "hard.h5")).st_ino == os.stat(data).st_ino,
          "adopt: the links to the input were replaced")
    check(temporaries(d, "data.h5") + temporaries(d, "link.h5") + temporaries(d, "hard.h5") == [],
          "adopt: temporary files left")
    # Still a good adopt input: it adopts and the checkpoint loads.
    out = os.path.join(d, "ok.h5")
    if expect(tool("adopt", data, "--model-config", CFG, "--out", out), 0, "adopt the input afterwards"):
        expect(tool("load", out, "--verify", "--quiet"), 0, "load the checkpoint adopted afterwards")
    print("adopt: never replaces its input (same name, symbolic link, hard link)")


def external_storage():
    """5. The plain file beside an adopted checkpoint is opened as a regular file by its name only."""
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

    # Version 1 files made by h5py: external storage in an absolute path, and in a plain name that is a
    # symbolic link. A control file with a regular external file loads.
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
    print("external storage: symbolic links, FIFOs and devices in place of the plain file are refused")


def deep_paths():
    """6. Relative paths below a working directory deeper than PATH_MAX."""
    top = os.getcwd()
    base = tempfile.mkdtemp(prefix="deep-", dir=work)
    made = []
    codes = {}
    try:
        os.chdir(base)
        for i in range(40):  # 40 x 201 characters: about 8 KiB, twice PATH_MAX
            name = f"{i:02d}" + "d" * 198
            os.mkdir(name)
            os.chdir(name)
            made.append(name)
        for cmd in (["demo", "--out", "d.h5", "--quiet"] + SMALL, ["verify", "d.h5"], ["load", "d.h5", "--quiet"],
                    ["inspect", "d.h5"], ["reshard", "d.h5", "r.h5", "--quiet"]):
            r = run([exe] + cmd, timeout=60, cwd=None)  # the subprocess inherits the deep cwd
            codes[cmd[0]] = r.rc
            # Guards: no crash on ENAMETOOLONG paths (absolute names of the cwd cannot be formed), and
            # relative names work: each command succeeds.
            check(r.rc is not None and r.rc >= 0, f"deep path: {cmd[0]} died: {r}")
            check(r.rc == 0, f"deep path: {cmd[0]}: {r}")
        check(temporaries(".", "d.h5") == [] and temporaries(".", "r.h5") == [], "deep path: temporary files left")
    finally:
        # Climb back level by level, removing each level's (now shallow) subtree by its relative name.
        try:
            for name in reversed(made):
                os.chdir("..")
                shutil.rmtree(name, ignore_errors=True)
        finally:
            os.chdir(top)
        shutil.rmtree(base, ignore_errors=True)
    check(not os.path.exists(base), "deep path: the deep tree could not be removed")
    print("deep paths: exit codes " + ", ".join(f"{k} {v}" for k, v in codes.items()))


def reshard_never_mixes():
    """7. A path renamed over again and again by two checkpoints with one id: every output is one of them."""
    d = os.path.join(work, "race")
    os.mkdir(d)
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


def concurrent_saves():
    """9. Two saves to one path at once: each has its own temporary file, and the path always holds one
    complete checkpoint (before, they shared `<path>.partial` and could commit a broken file)."""
    d = os.path.join(work, "concurrent")
    os.mkdir(d)
    p = os.path.join(d, "p.h5")
    models = [["--layers", "1", "--mamba-layers", "0", "--cols", "64"], ["--layers", "2", "--mamba-layers", "1", "--cols", "128"]]
    tensors, inputs = [], []
    for i, m in enumerate(models):
        out = os.path.join(d, f"model{i}.h5")
        expect(demo(out, *m), 0, f"demo model {i}")
        j = inspect_json(out)
        tensors.append(len(j["tensors"]) if j else -1)
        inputs.append(out)
    check(tensors[0] != tensors[1], f"the two models differ in tensor count: {tensors}")

    def round_of(name, commands, n, save_only):
        procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            seen[(name, proc.returncode)] = seen.get((name, proc.returncode), 0) + 1
            # The save itself must succeed (a failed save says "saving ..."). reshard only saves, so it
            # must exit 0; demo then reloads the path, which the other demo may have replaced by then
            # (a clear load error naming the shapes, not a broken file).
            check("error: saving" not in err, f"{name} round {n}: the save failed: {err.strip()[:600]}")
            if save_only:
                check(proc.returncode == 0, f"{name} round {n}: exited {proc.returncode}: {err.strip()[:600]}")
            else:
                check(proc.returncode == 0 or (proc.returncode == 2 and "error: loading" in err),
                      f"{name} round {n}: exited {proc.returncode}: {err.strip()[:600]}")
        expect(tool("verify", p), 0, f"{name} round {n}: verify")
        j = inspect_json(p)
        check(j is not None and len(j["tensors"]) in tensors, f"{name} round {n}: the path holds neither model")
        check(temporaries(d, "p.h5") == [], f"{name} round {n}: temporary files left: {temporaries(d, 'p.h5')}")

    seen = {}
    for n in range(10):
        round_of("reshard", [[exe, "reshard", src, p, "--quiet"] for src in inputs], n, True)
    for n in range(8):
        round_of("demo", [[exe, "demo", "--out", p, "--quiet"] + m for m in models], n, False)
    print("concurrent saves: exit codes seen " + ", ".join(f"{k[0]} {k[1]}: {v}" for k, v in sorted(seen.items())))


def closed_streams():
    """10. With fd 0, 1 or 2 closed the checkpoint may get that descriptor: no message may land in it."""
    d = os.path.join(work, "streams")
    os.mkdir(d)
    for closed in ["2>&-", ">&-", "<&-", "<&- >&- 2>&-"]:
        x = os.path.join(d, "x.h5")
        remove_any(x)
        r = run(["bash", "-c", f'exec {closed}; exec "$0" demo --out "$1" --phases ' + " ".join(SMALL), exe, x])
        what = f"demo with {closed}"
        # Guard: the save completes whether or not it can report (no exit by a signal, e.g. SIGPIPE).
        check(r.rc is not None and r.rc >= 0 and (r.rc == 0 or closed == ">&-"), f"{what}: {r}")
        content = open(x, "rb").read() if os.path.isfile(x) else b""
        check(content.startswith(SIGNATURE), f"{what}: the checkpoint does not start with the HDF5 signature")
        check(b"save phase" not in content and b"pad rows skipped" not in content,
              f"{what}: the tool's messages were written into the checkpoint")
        expect(tool("verify", x), 0, f"{what}: verify")
    print("closed standard streams: nothing written into the checkpoint")


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


def resources():
    """13. Limits on files and memory end in one error line; a load that cannot fit is refused up front."""
    # 64 thread ranks with 16 descriptors: it loads within them or ends with one error line; never a crash.
    r = run(["prlimit", "--nofile=16:16", exe, "load", A, "--ranks", "64", "--tp", "1", "--gtp", "4", "--quiet"], timeout=60)
    check(r.rc is not None and r.rc >= 0, f"load --ranks 64 with 16 open files: {r}")
    check(r.rc in (0, 2) and (r.rc == 0 or one_error_line(r)), f"load --ranks 64 with 16 open files: {r}")
    nofile16 = r.rc
    # With 4 descriptors the checkpoint cannot even be opened: one error line.
    r = run(["prlimit", "--nofile=4:4", exe, "load", A, "--ranks", "64", "--tp", "1", "--gtp", "4", "--quiet"], timeout=60)
    check(r.rc == 2 and one_error_line(r), f"load with 4 open files: {r}")
    # 1 GiB of address space: an ordinary load fits, one of 1.2 GiB of shards (alignment 2^20) or of
    # 1.2 TiB (alignment 2^30) does not, and says so in bytes of host memory.
    limit = ["prlimit", f"--as={1 << 30}"]
    expect(run(limit + [exe, "load", A, "--quiet"]), 0, "an ordinary load within 1 GiB of address space")
    for align in ["1048576", "1073741824"]:
        r = run(limit + [exe, "load", A, "--tp", "1", "--gtp", "4", "--align", align, "--quiet"], timeout=60)
        what = f"load at alignment {align} within 1 GiB of address space"
        check(r.rc == 2 and one_error_line(r) and "bytes of host memory" in r.err, f"{what}: {r}")
    # 2^24 rows of alignment: shards of about 19 GiB for a 26 KiB checkpoint; 2^30: over a PiB. Each is
    # refused at once, naming the bytes, where it does not fit (the 2^24 one under 4 GiB of address
    # space, the 2^30 one on any machine), before anything is allocated.
    for align, limit in [("16777216", [f"--as={4 << 30}"]), ("1073741824", [])]:
        start = time.time()
        r = run(["prlimit"] + limit + [exe, "load", A, "--tp", "1", "--gtp", "4", "--align", align, "--quiet"]
                if limit else [exe, "load", A, "--tp", "1", "--gtp", "4", "--align", align, "--quiet"], timeout=20)
        check(r.rc == 2 and one_error_line(r) and "bytes of host memory" in r.err and time.time() - start < 10,
              f"load at alignment {align}: {r}")
    print(f"resources: 16 open files exit {nofile16}; huge alignments refused in bytes")


try:
    if args.part == "shared":
        shared_part(*attacker)
    else:
        for section in (permissions, only_regular_files, adopt_never_replaces_its_input, external_storage, deep_paths,
                        reshard_never_mixes, virtual_datasets, concurrent_saves, closed_streams,
                        small_types_with_pad_rows, stale_temporary_files, resources):
            try:
                section()
            except Exception as e:  # a section that breaks is a failure, not the end of the others
                check(False, f"{section.__name__} raised {type(e).__name__}: {e}")
finally:
    shutil.rmtree(work, ignore_errors=True)
finish("trust")
