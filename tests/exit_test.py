#!/usr/bin/python3
"""Exit is part of the run: the C example (save at GTP 2, load at GTP 1) and the tool's demo (an async
save from emulated device memory through a Saver's background thread, a reload, a check), each run
many times while two busy loops hold the CPUs, must exit 0: never by a signal (a joinable thread
destroyed at exit aborts with SIGABRT), never after printing its result.

Usage: exit_test.py path/to/capi_c_example path/to/shardckpt
Prints "exit: N passed, N failed".
"""
import os
import signal
import subprocess
import sys
import tempfile

from tally import check, finish

RUNS = 12
c_example, tool = sys.argv[1], sys.argv[2]
SMALL = ["--layers", "1", "--mamba-layers", "1", "--cols", "32"]


def busy():
    """A process that spins until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def outcome(rc):
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


with tempfile.TemporaryDirectory() as work:
    loops = [busy(), busy()]
    try:
        commands = {
            "C example": [c_example, os.path.join(work, "c.h5")],
            "demo --async (emulated device)": [tool, "demo", "--out", os.path.join(work, "d.h5"), *SMALL,
                                               "--device", "emulated", "--async", "--ranks", "8"],
            "demo --async --optimizer adam": [tool, "demo", "--out", os.path.join(work, "a.h5"), *SMALL, "--async",
                                              "--optimizer", "adam", "--distributed-optimizer", "--dp", "2"],
        }
        for what, argv in commands.items():
            results = []
            for _ in range(RUNS):
                p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
                results.append((p.returncode, p.stderr.decode(errors="replace")[-300:]))
            bad = [(rc, err) for rc, err in results if rc != 0]
            check(not bad, f"{what}: {len(bad)} of {RUNS} runs under load did not exit 0"
                           + (f" (first: {outcome(bad[0][0])}: {bad[0][1]})" if bad else ""))
    finally:
        for p in loops:
            p.kill()
            p.wait()
finish("exit")
