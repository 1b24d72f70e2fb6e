#!/usr/bin/python3
"""Kill tests: saves are killed with SIGKILL, again and again, at seeded random moments (thread
ranks, one MPI rank, the whole MPI job, and inside the commit window); after every kill the path
must hold a complete checkpoint that verifies, the earlier one or the new one.

Usage: kill_test.py path/to/shardckpt [--kills N] [--seed S]
Prints "kill test: N passed, N failed" and exits non-zero on any failure.
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time

from tally import check, finish

parser = argparse.ArgumentParser()
parser.add_argument("exe")
parser.add_argument("--kills", type=int, default=60)
parser.add_argument("--seed", type=int, default=20261130)
args = parser.parse_args()
rng = random.Random(args.seed)
exe = args.exe
work = tempfile.mkdtemp(prefix="shardckpt-kill-")
path = os.path.join(work, "ckpt.h5")
# Two models of different sizes: after a kill the path holds one or the other, complete.
models = {
    "small": ["--layers", "2", "--mamba-layers", "1", "--cols", "512"],
    "large": ["--layers", "6", "--mamba-layers", "2", "--cols", "1024"],
}
mpirun = shutil.which("mpirun")
mpi = [mpirun, "-np", "4", "--oversubscribe"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
env = dict(os.environ)
env.pop("MALLOC_PERTURB_", None)  # mpirun's PMIx server crashes on it (see cli_test.sh)
env.setdefault("ASAN_OPTIONS", "")
env["ASAN_OPTIONS"] += ":detect_leaks=0"  # a killed process leaks by definition


def holds_a_complete_checkpoint(what):
    """The path verifies (every byte against its checksum) and loads with every value right."""
    v = subprocess.run([exe, "verify", path], capture_output=True, text=True, env=env)
    check(v.returncode == 0, f"{what}: verify exited {v.returncode}: {v.stdout}{v.stderr}")
    l = subprocess.run([exe, "load", path, "--tp", "1", "--gtp", "2", "--align", "8", "--verify", "--quiet"],
                       capture_output=True, text=True, env=env)
    check(l.returncode == 0, f"{what}: load --verify exited {l.returncode}: {l.stderr}")


def demo(model, extra, mpi_job=False):
    cmd = [exe, "demo", "--out", path, "--phases", "--quiet"] + models[model] + extra
    if mpi_job:
        cmd = mpi + cmd + ["--mpi"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def wait_for_phase(proc, phase, limit=30):
    """Reads the save's phases until `phase` begins; False if the process ended first."""
    deadline = time.time() + limit
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            return False
        if line.strip() == "shardckpt: save phase: " + phase:
            return True
    return False


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kill_one_rank(proc):
    """SIGKILL one rank process of an mpirun job (the engine then ends the others)."""
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    if children:
        try:
            os.kill(int(rng.choice(children)), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_group(proc)


subprocess.run([exe, "demo", "--out", path, "--quiet"] + models["small"], check=True, env=env,
               stdout=subprocess.DEVNULL)
scenarios = ["threads", "threads", "commit window", "hyperslab"] + (["mpi rank", "mpi job", "mpi commit"] if mpirun else [])
kills = {}
for n in range(args.kills):
    scenario = rng.choice(scenarios)
    model = rng.choice(list(models))
    extra = ["--method", "hyperslab"] if scenario == "hyperslab" else []
    proc = demo(model, extra, mpi_job=scenario.startswith("mpi"))
    # Wait for the save to be under way, then kill it somewhere in its writing or commit window.
    phase = "committing" if "commit" in scenario else "writing"
    if wait_for_phase(proc, phase):
        time.sleep(rng.uniform(0, 0.003 if "commit" in scenario else 0.15))
    if scenario == "mpi rank":
        kill_one_rank(proc)
    else:
        kill_group(proc)
    kills[scenario] = kills.get(scenario, 0) + 1
    holds_a_complete_checkpoint(f"kill {n} ({scenario}, {model} model)")

shutil.rmtree(work, ignore_errors=True)
print("kills:", ", ".join(f"{k} {v}" for k, v in sorted(kills.items())))
finish("kill test")
