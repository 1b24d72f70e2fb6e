"""Single-user checks of what a save writes and where: permissions, only regular files replaced,
adopt never replacing its input, concurrent saves to one path, closed standard streams."""
import grp
import os
import shutil
import socket
import stat
import subprocess

from tally import check
from trust.support import (A, CFG, SIGNATURE, SMALL, demo, exe, expect, identity, inspect_json, is_root, plain_in,
                           remove_any, run, temporaries, tool, work)


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


def make_special(kind, out, link_target, sockets):
    """Makes a KIND at OUT (a bound socket is kept in SOCKETS until the end)."""
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


def save_to_special(which, kind, d, link_target, null_before, sockets):
    """A save by WHICH to a KIND is refused, naming it; the KIND, the device a link points at and
    /dev/null are left as they were."""
    out = os.path.join(d, f"{which}-{kind.replace(' ', '-').replace('/', '')}")
    make_special(kind, out, link_target, sockets)
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


def save_to_link_to_regular_file(which, d):
    """A symbolic link to a regular file: its target is replaced, the link stays a link."""
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
            save_to_special(which, kind, d, link_target, null_before, sockets)
        save_to_link_to_regular_file(which, d)
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

