#!/usr/bin/python3
"""Files cut short under the tool: `shardckpt reshard`, `load` and `verify` of a checkpoint that
another program truncates to 1 MiB while the command runs (at moments spread over the command's own
run time, a bounded number of tries each) must end in an error (exit 1 or 2, a message on stderr)
or succeed, never die by a signal: a file cut short under a mapping of it is Errc::replaced
(docs/python.md, "Reads over the file").

Usage: truncate_test.py path/to/shardckpt [--tries N]
Prints "truncate test: N passed, N failed" and exits non-zero on any failure.
"""
import argparse
import os
import shutil
import subprocess
import tempfile
import time

from tally import check, finish

parser = argparse.ArgumentParser()
parser.add_argument("exe")
parser.add_argument("--tries", type=int, default=10)
args = parser.parse_args()
work = tempfile.mkdtemp(prefix="shardckpt-truncate-")
master = os.path.join(work, "master.h5")
path = os.path.join(work, "w.h5")
out = os.path.join(work, "out.h5")
env = dict(os.environ)
env.setdefault("ASAN_OPTIONS", "")
env["ASAN_OPTIONS"] += ":detect_leaks=0"

subprocess.run([args.exe, "demo", "--out", master, "--layers", "4", "--mamba-layers", "2", "--cols", "2048",
                "--dtype", "f32", "--json"], check=True, stdout=subprocess.DEVNULL, env=env)
commands = {
    "reshard": [args.exe, "reshard", path, out, "--tp", "1", "--gtp", "4", "--align", "8"],
    "load": [args.exe, "load", path, "--tp", "1", "--gtp", "4", "--align", "8"],
    "verify": [args.exe, "verify", path],
}
try:
    for name, command in commands.items():
        shutil.copyfile(master, path)
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
        span = time.perf_counter() - start
        cut = 0
        for i in range(args.tries):
            shutil.copyfile(master, path)
            run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
            time.sleep(span * (0.05 + 0.9 * i / max(1, args.tries - 1)))
            os.truncate(path, 1 << 20)
            _, err = run.communicate(timeout=120)
            what = f"{name}, cut at try {i}: exit {run.returncode}: {err.strip()[-400:]}"
            check(run.returncode >= 0, what + " (killed by a signal)")
            check(run.returncode in (0, 1, 2), what)
            if run.returncode != 0:
                cut += 1
                check("error" in err, what + " (no error message)")
        print(f"{name}: {cut} of {args.tries} runs cut short ended in an error, the others succeeded")
finally:
    shutil.rmtree(work, ignore_errors=True)
finish("truncate test")
