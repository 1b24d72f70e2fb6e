#!/usr/bin/python3
"""The benchmark runs every phase, small, and every value it loads is the value saved: the bench
is a program users run, so a phase that fails or loads wrong bytes fails this test. No timing is
checked here (figures belong to docs/performance.md, from full runs).
Usage: bench_smoke.py SHARDCKPT_BENCH [--no-seed-geometry]. Prints "bench: N passed, N failed".
--no-seed-geometry (the run under ASan, where 512 thread ranks take minutes) skips the seed-geometry
phase, which the plain build's run covers."""
import json
import subprocess
import sys
import tempfile

from tally import check, finish

seed = "--no-seed-geometry" not in sys.argv[2:]
# The seed-geometry phase's figures: there when it ran, absent when it was skipped.
seed_peak, seed_mismatches = "seed_geometry_peak_rss_bytes", "seed_geometry_mismatches"
with tempfile.TemporaryDirectory() as work:
    run = subprocess.run([sys.argv[1], *sys.argv[2:], "--size-mib", "8", "--repeat", "1", "--read-repeat", "1",
                          "--device", "emulated", "--no-h5py", "--async-budget-mib", "2", "--json", "--dir", work],
                         capture_output=True, text=True)
    check(run.returncode == 0, f"the bench failed ({run.returncode}): {run.stderr[-2000:]}")
    figures = json.loads(run.stdout) if run.returncode == 0 else {}
    for key in ("save_gbps", "load_gbps", "load_into_gbps", "reshard_load_gbps", "device_save_gbps",
                "device_load_gbps", "write_balance", "plan_seed_scale_us_per_rank",
                "async_bounded_blocking_s_w0", "async_bounded_blocking_s_w2", "async_bounded_total_ratio_w0",
                "async_bounded_peak_host_bytes", "async_full_blocking_s") + ((seed_peak,) if seed else ()):
        check(key in figures, f"no figure {key}: a phase did not run")
    check(seed or not {seed_peak, seed_mismatches} & figures.keys(), "--no-seed-geometry ran the seed-geometry phase")
    # The bounded phase streamed (its budget below the rank's bytes) from the emulated device.
    check(0 < figures.get("async_bounded_budget_bytes", 0) < figures.get("bytes", 0) and
          figures.get("async_bounded_device") == "emulated", "the bounded async phase did not stream")
    for key in ("mismatches", "replica_mismatches", "device_mismatches", "async_bounded_mismatches") + \
            ((seed_mismatches,) if seed else ()):
        check(figures.get(key) == 0, f"{key} = {figures.get(key)}: loaded values differ from those saved")
    check(figures.get("verified_values", 0) > 0, "the bench verified no value")
finish("bench")
