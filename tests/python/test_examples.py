"""The Python examples of docs/python.md run as their users run them: examples/python/quickstart.py
on 4 processes started the way torchrun starts them (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
examples/python/state_dict_resume.py alone and on 2 (examples/python/dcp_storage.py needs torch 2.x:
tests/torch2)."""
import os
import shutil
import tempfile
import unittest

from support import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Examples(unittest.TestCase):
    def test_quickstart_on_four_processes(self):
        out = tempfile.mkdtemp(prefix="sc-quickstart-")
        try:
            results = run_ranks(4, os.path.join(ROOT, "examples/python/quickstart.py"), out)
            for rank, (rc, text) in enumerate(results):
                self.assertEqual(rc, 0, f"rank {rank}:\n{text}")
            self.assertIn("saved at TP 2 x GTP 2, loaded at TP 1 x GTP 4: step 100", results[0][1])
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def test_state_dict_resume_alone_and_on_two_processes(self):
        import subprocess
        import sys
        script = os.path.join(ROOT, "examples/python/state_dict_resume.py")
        out = tempfile.mkdtemp(prefix="sc-state-dict-")
        try:
            alone = subprocess.run([sys.executable, script, out], capture_output=True, text=True, timeout=300)
            self.assertEqual(alone.returncode, 0, alone.stdout + alone.stderr)
            self.assertIn("resumed at step 3: the next 2 steps match", alone.stdout)
            results = run_ranks(2, script, out)
            for rank, (rc, text) in enumerate(results):
                self.assertEqual(rc, 0, f"rank {rank}:\n{text}")
            self.assertIn("resumed at step 3: the next 2 steps match", results[0][1])
        finally:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
