"""Jobs of 3 gloo processes end as torchrun's jobs do: each process exits after its last call, without
destroy_process_group, one in two with an async save still in flight that nobody waits for. Every
process must exit 0: a thread of the library or the binding that outlives the interpreter's
finalization and takes the GIL is ended by pthread_exit inside C++ frames, which aborts the process
(SIGABRT, "terminate called without an active exception") after it printed its result. Two busy
loops beside the jobs make the scheduler interleave them as a loaded machine does."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

import torch

import shardckpt as sc
from support import finish_ranks, reference, run_ranks, spec_at, start_ranks

WORKER = os.path.join(os.path.dirname(__file__), "exit_worker.py")
RUNS, AT_ONCE = 12, 3


class ExitOfJobs(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-exit-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_every_process_exits_cleanly_with_a_save_in_flight_and_without_destroying_the_group(self):
        self.assertTrue(all(rc == 0 for rc, _ in run_ranks(3, WORKER, "save", self.dir)))
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        start, failures, dirs = time.time(), [], []
        try:
            for wave in range(0, RUNS, AT_ONCE):
                jobs = []
                for run in range(wave, min(wave + AT_ONCE, RUNS)):
                    what = "async" if run % 2 else "load"
                    out = self.dir if what == "load" else tempfile.mkdtemp(dir=self.dir)
                    if what == "async":
                        dirs.append(out)
                    jobs.append((run, what, start_ranks(3, WORKER, what, out)))
                for run, what, procs in jobs:
                    for rank, (rc, text) in enumerate(finish_ranks(procs, timeout=60)):
                        if rc != 0 or f"{what} done on rank {rank}" not in text:
                            failures.append(f"run {run} ({what}), rank {rank}: exit status {rc}: {text[-300:]}")
        finally:
            for b in busy:
                b.kill()
                b.wait()
        self.assertEqual(failures, [], f"{len(failures)} processes of {RUNS * 3} failed:\n" + "\n".join(failures))
        # The saves nobody waited for ended at exit: each checkpoint is complete.
        want = reference(1, 0)
        for out in dirs:
            got = sc.read(os.path.join(out, "async.h5"))[spec_at(1).key]
            self.assertTrue(torch.equal(got, want), out)
        self.assertLess(time.time() - start, 150)  # about 45 s on 2 busy cores

    def test_a_save_begun_after_the_exit_hook_runs_in_the_callers_thread_or_is_refused(self):
        # atexit runs hooks last in, first out: one registered before shardckpt was imported runs
        # after shardckpt's, when no saver's thread may start any more.
        script = textwrap.dedent("""
            import atexit, os, sys
            class One:  # this process as a Python group: a save's collectives take the GIL
                rank = lambda self: 0
                size = lambda self: 1
                barrier = lambda self: None
                split = lambda self, color, key: self
                all_gather_rows = lambda self, rows, counts: None
                device_index = lambda self: -1
                supports_background = lambda self: True
                broadcast_bytes = lambda self, data, root: data
                all_gather_bytes = lambda self, data: [data]
            def late():
                s = sc.StateDict()
                s.add_common("step", 1)
                saver = sc.Saver(One())
                saver.save(s, os.path.join(sys.argv[1], "late.h5"))  # in this thread: fine
                try:
                    saver.save_async(s, os.path.join(sys.argv[1], "late_async.h5"))
                except sc.Error as e:
                    print("refused:", e)
            atexit.register(late)
            import shardckpt as sc
            open_saver = sc.Saver()  # still open at exit: closed by the hook
        """)
        p = subprocess.run([sys.executable, "-c", script, self.dir], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, f"exit status {p.returncode}:\n{p.stdout}\n{p.stderr}")
        self.assertIn("refused: save_async at interpreter exit", p.stdout)
        self.assertEqual(sc.inspect(os.path.join(self.dir, "late.h5"))["common"], {"step": 1})

    def test_a_closed_saver_refuses_every_call(self):
        saver = sc.Saver()
        saver.close()
        saver.close()  # closing twice is nothing
        for call in (lambda: saver.save(sc.StateDict(), os.path.join(self.dir, "a.h5")),
                     lambda: saver.save_async(sc.StateDict(), os.path.join(self.dir, "a.h5")),
                     saver.async_host_bytes, saver.staging_bytes):
            with self.assertRaises(sc.Error) as e:
                call()
            self.assertEqual(e.exception.code, "invalid_argument")
            self.assertIn("this Saver is closed", str(e.exception))


if __name__ == "__main__":
    unittest.main()
