"""Shared part: a save never writes through, nor touches, a name another user planted."""
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time

from tally import check
from trust.support import A, CFG, SMALL, Result, exe, expect, plain_in, remove_any, run, temporaries, tool

KINDS = ["symlink to root's file", "dangling symlink", "0666 file of nobody's", "hard link to root's file"]


class Scene:
    """A world-writable sticky directory `shared`, where nobody plants the name old versions wrote
    (ckpt.h5.partial), and root's file `victim` in root's directory `secret`, which the plants point at."""

    def __init__(self, as_nobody):
        self.as_nobody = as_nobody
        self.shared = tempfile.mkdtemp(prefix="shardckpt-trust-shared-", dir="/tmp")
        os.chmod(self.shared, 0o1777)  # world-writable and sticky, as /tmp
        self.secret = tempfile.mkdtemp(prefix="shardckpt-trust-secret-", dir="/tmp")  # root's alone (0700)
        os.chmod(self.secret, 0o700)
        self.victim = os.path.join(self.secret, "victim")
        self.victim_bytes = b"root's file: a save must never write here\n"
        with open(self.victim, "wb") as f:
            f.write(self.victim_bytes)
        os.chmod(self.victim, 0o640)
        self.victim_st = os.stat(self.victim)
        self.dangling = os.path.join(self.secret, "created-by-a-save")
        self.ckpt = os.path.join(self.shared, "ckpt.h5")
        self.planted = os.path.join(self.shared, "ckpt.h5.partial")  # the name old versions wrote
        adopt_input = plain_in(self.shared, "data.h5")  # adopt's --out must be beside its input
        self.planted_bytes = b"nobody's file\n"
        ckpt = self.ckpt
        self.commands = {
            "demo": [exe, "demo", "--out", ckpt, "--quiet"] + SMALL,
            "demo --method hyperslab": [exe, "demo", "--out", ckpt, "--quiet", "--method", "hyperslab"] + SMALL,
            "reshard": [exe, "reshard", A, ckpt, "--quiet"],
            "adopt": [exe, "adopt", adopt_input, "--model-config", CFG, "--out", ckpt],
        }

    def plant(self, kind):
        planted, as_nobody = self.planted, self.as_nobody
        remove_any(planted)
        remove_any(self.ckpt)
        if kind == "symlink to root's file":
            r = run(as_nobody + ["ln", "-s", self.victim, planted])
        elif kind == "dangling symlink":
            r = run(as_nobody + ["ln", "-s", self.dangling, planted])
        elif kind == "0666 file of nobody's":
            r = run(as_nobody + ["/bin/sh", "-c", 'umask 0; printf "%s" "$2" > "$1"', "sh", planted,
                                 self.planted_bytes.decode()])
        else:  # hard link to root's file, made by root standing in for an attacker
            os.link(self.victim, planted)
            r = Result(0, "", "")
        check(r.rc == 0 and os.path.lexists(planted), f"plant a {kind}: {r}")
        st = os.lstat(planted)
        # The planted object, as the attacker left it: what each save must leave exactly so.
        return {"ino": st.st_ino, "uid": st.st_uid, "mode": st.st_mode,
                "link": os.readlink(planted) if stat.S_ISLNK(st.st_mode) else None,
                "bytes": open(planted, "rb").read() if stat.S_ISREG(st.st_mode) else None}

    def save_around(self, what, cmd, before):
        """One save with the plant BEFORE in place: it succeeds and leaves the plant and root's file alone."""
        victim, victim_st, planted, ckpt = self.victim, self.victim_st, self.planted, self.ckpt
        r = run(cmd)
        # The save succeeds: the planted name is not in its way (it is not the name a save uses).
        expect(r, 0, what)
        # Root's file is neither written nor chmod-ed through a link; nothing is created in root's
        # directory through a dangling link.
        st = os.stat(victim)
        check(open(victim, "rb").read() == self.victim_bytes, f"{what}: root's file was written through the plant")
        check(stat.S_IMODE(st.st_mode) == 0o640 and st.st_uid == victim_st.st_uid,
              f"{what}: root's file changed mode or owner: {oct(st.st_mode)} uid {st.st_uid}")
        check(not os.path.lexists(self.dangling), f"{what}: a file was created through the dangling link")
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
        check(temporaries(self.shared, "ckpt.h5") == [],
              f"{what}: temporary files left: {temporaries(self.shared, 'ckpt.h5')}")


def stopped(pid):
    """Waits (up to 10 s) until process `pid` is stopped (state T in /proc/PID/stat)."""
    for _ in range(10000):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return True
        time.sleep(0.001)
    return False


def stopped_save(shared, ckpt):
    """The temporary file of a save stopped (SIGSTOP) in its writing phase: (names, mode, uid,
    regular), or None when no try saw one. A try counts only if the save had not yet said
    `committing` when it stopped: the commit gives the file its final mode before the rename, and on a
    loaded machine the save may get that far between saying `writing` and the stop."""
    seen = None
    for attempt in range(8):
        p = subprocess.Popen([exe, "demo", "--out", ckpt, "--phases", "--quiet", "--cols", "1024"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        fd, said, writing = p.stderr.fileno(), b"", b"shardckpt: save phase: writing\n"
        try:
            while writing not in said:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                said += chunk
            if writing in said:
                p.send_signal(signal.SIGSTOP)
                if stopped(p.pid):
                    temps = temporaries(shared, "ckpt.h5")
                    # What it said before it stopped is in the pipe: one read takes all of it.
                    os.set_blocking(fd, False)
                    try:
                        said += os.read(fd, 1 << 16) or b""
                    except BlockingIOError:
                        pass
                    os.set_blocking(fd, True)
                    if temps and b"save phase: committing" not in said:
                        st = os.lstat(os.path.join(shared, temps[0]))
                        seen = (temps, stat.S_IMODE(st.st_mode), st.st_uid, stat.S_ISREG(st.st_mode))
                p.send_signal(signal.SIGCONT)
            p.stderr.read()
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
            p.wait()
        if seen:
            break
    return seen


def temporary_file_while_a_save_writes(shared, ckpt):
    """While a save writes, its temporary file is .ckpt.h5.<32 hex digits>.partial, mode 0600, root's
    (an unpredictable name nobody can plant; unreadable by others until renamed)."""
    pattern = re.compile(r"^\.ckpt\.h5\.[0-9a-f]{32}\.partial$")
    seen = stopped_save(shared, ckpt)
    check(seen is not None, "a save's temporary file (.ckpt.h5.<32 hex>.partial) was never seen while it wrote")
    if seen:
        temps, mode, uid, regular = seen
        check(len(temps) == 1 and pattern.match(temps[0]), f"temporary file name {temps} is not .ckpt.h5.<32 hex>.partial")
        check(mode == 0o600 and uid == 0 and regular, f"temporary file {temps}: mode {oct(mode)}, uid {uid}, not 0600 root's")
        print(f"shared: a save writes {temps[0]} (mode {oct(mode)})")
    expect(tool("verify", ckpt), 0, "verify after the stopped save")


def shared_part(nobody, as_nobody):
    """1. nobody plants the old temporary name; root's saves neither write through it nor touch it."""
    s = Scene(as_nobody)
    for kind in KINDS:
        before = s.plant(kind)
        if kind != "hard link to root's file":
            check(before["uid"] == nobody.pw_uid, f"{kind}: planted by nobody")
        if kind == "0666 file of nobody's":
            check(stat.S_IMODE(before["mode"]) == 0o666, f"{kind}: planted with mode 0666")
        for name, cmd in s.commands.items():
            s.save_around(f"shared dir, planted {kind}, {name}", cmd, before)
        print(f"shared: planted {kind}: every save went around it")
    remove_any(s.planted)
    temporary_file_while_a_save_writes(s.shared, s.ckpt)
    shutil.rmtree(s.shared, ignore_errors=True)
    shutil.rmtree(s.secret, ignore_errors=True)
