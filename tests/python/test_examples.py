"""The Python examples of docs/python.md run as their users run them: examples/python/quickstart.py
on 4 processes started the way torchrun starts them (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
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


if __name__ == "__main__":
    unittest.main()
