#!/usr/bin/python3
"""The benchmark runs every phase, small, and every value it loads is the value saved: the bench
is a program users run, so a phase that fails or loads wrong bytes fails this test. No timing is
checked here (figures belong to docs/performance.md, from full runs).
Usage: bench_smoke.py SHARDCKPT_BENCH [--no-seed-geometry]. Prints "bench: N passed, N failed".
The bench runs twice: every phase but the seed geometry (--no-seed-geometry), then that phase
alone (--only seed-geometry), each run checked to have left the other's figures out.
--no-seed-geometry here (a sanitized build, where 512 thread ranks take minutes) leaves out the
second run."""
import json
import subprocess
import sys
import tempfile

from tally import check, finish

seed = "--no-seed-geometry" not in sys.argv[2:]
# The seed-geometry phase's figures: there when it ran, absent when it was skipped.
seed_peak, seed_mismatches = "seed_geometry_peak_rss_bytes", "seed_geometry_mismatches"
# What every other phase reports.
phases = ("save_gbps", "load_gbps", "load_into_gbps", "reshard_load_gbps", "device_save_gbps", "device_load_gbps",
          "write_balance", "plan_seed_scale_us_per_rank", "async_bounded_blocking_s_w0", "async_bounded_blocking_s_w2",
          "async_bounded_total_ratio_w0", "async_bounded_peak_host_bytes", "async_full_blocking_s")


def bench(*flags):
    """The bench's figures for a small run with `flags` (empty if it failed)."""
    with tempfile.TemporaryDirectory() as work:
        run = subprocess.run([sys.argv[1], *flags, "--size-mib", "8", "--repeat", "1", "--read-repeat", "1",
                              "--device", "emulated", "--no-h5py", "--async-budget-mib", "2", "--json", "--dir", work],
                             capture_output=True, text=True)
    check(run.returncode == 0, f"the bench {' '.join(flags)} failed ({run.returncode}): {run.stderr[-2000:]}")
    return json.loads(run.stdout) if run.returncode == 0 else {}


figures = bench("--no-seed-geometry")
for key in phases:
    check(key in figures, f"no figure {key}: a phase did not run")
check(not {seed_peak, seed_mismatches} & figures.keys(), "--no-seed-geometry ran the seed-geometry phase")
# The bounded phase streamed (its budget below the rank's bytes) from the emulated device.
check(0 < figures.get("async_bounded_budget_bytes", 0) < figures.get("bytes", 0) and
      figures.get("async_bounded_device") == "emulated", "the bounded async phase did not stream")
for key in ("mismatches", "replica_mismatches", "device_mismatches", "async_bounded_mismatches"):
    check(figures.get(key) == 0, f"{key} = {figures.get(key)}: loaded values differ from those saved")
check(figures.get("verified_values", 0) > 0, "the bench verified no value")

if seed:
    alone = bench("--only", "seed-geometry")
    check(seed_peak in alone and alone.get(seed_mismatches) == 0,
          f"the seed-geometry phase: {seed_mismatches} = {alone.get(seed_mismatches)}, peak {alone.get(seed_peak)}")
    check(not set(phases) & alone.keys(), f"--only seed-geometry ran other phases: {set(phases) & alone.keys()}")
finish("bench")
