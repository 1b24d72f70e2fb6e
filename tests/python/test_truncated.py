"""A file cut short by another program while shardckpt.read maps it: the read returns the saved
bytes or raises shardckpt.Error ("replaced" when the file was cut short under its mapping,
"not_a_checkpoint" when it was already shorter than its metadata says as the read opened it), and
the process never dies by SIGBUS (docs/python.md, "Reads over the file")."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "truncate_worker.py")


class CutShortUnderARead(unittest.TestCase):
    def test_a_file_cut_short_during_read_is_an_error_never_a_signal(self):
        work = tempfile.mkdtemp(prefix="sc-cut-")
        try:
            # The pages stay in the page cache (DROP=0): a try takes a fraction of a second, and
            # the reads are fast enough that cuts land in the mapped part of the read too.
            env = dict(os.environ, DROP="0")
            run = subprocess.run([sys.executable, WORKER, work, "20"], capture_output=True, text=True, env=env,
                                 timeout=300)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if run.returncode < 0:
            self.fail(f"the reading process died by {signal.Signals(-run.returncode).name}: {run.stderr[-2000:]}")
        self.assertEqual(run.returncode, 0, run.stderr[-2000:])
        report = json.loads(run.stdout.strip().splitlines()[-1])
        outcomes = report["outcomes"]
        self.assertLessEqual(set(outcomes), {"returned", "returned_then_cut", "replaced", "not_a_checkpoint"},
                             report)
        self.assertEqual(sum(outcomes.values()), 20, report)
        # The cuts landed inside reads (else the test tests nothing).
        self.assertGreater(outcomes.get("replaced", 0) + outcomes.get("not_a_checkpoint", 0), 0, report)


if __name__ == "__main__":
    unittest.main()
