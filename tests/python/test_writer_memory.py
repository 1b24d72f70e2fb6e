"""A save's memory does not grow with its rows: a writer holds at most 8,192 row checksums (64 KiB)
and the small writes it gathers, whatever the rows' width. A 1-D tensor's rows are single elements,
so 8 MiB of uint8 is 8,388,608 checksummed rows; a writer that kept the checksums of a whole 1 MiB
batch of them would hold 8 MiB. Measured in a fresh interpreter as the process's peak resident memory
during the save (reset first through /proc/self/clear_refs) above its resident memory before it."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

BODY = textwrap.dedent("""
    import sys
    import torch
    import shardckpt as sc

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    def state(n):
        t = torch.arange(256, dtype=torch.uint8).repeat(n // 256)
        s = sc.StateDict()
        s.add(sc.ShardedTensor("b", t, [n], [0]))
        return s, t

    small, _ = state(4096)
    sc.save(small, sys.argv[1])  # every code path loaded once
    big, t = state(8 << 20)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory starts again from the memory resident now
    before = status("VmRSS")
    sc.save(big, sys.argv[1])
    grew = status("VmHWM") - before
    assert torch.equal(sc.read(sys.argv[1])["b"], t)
    print("grew", grew)
""")


class WriterMemory(unittest.TestCase):
    def test_a_save_of_narrow_rows_holds_no_memory_per_row(self):
        work = tempfile.mkdtemp(prefix="sc-writer-memory-")
        try:
            p = subprocess.run([sys.executable, "-c", BODY, os.path.join(work, "a.h5")], capture_output=True,
                               text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stderr)
            grew = int(p.stdout.split("grew")[1])
            self.assertLess(grew, 4 << 20, f"the save's peak memory grew by {grew} bytes for 8 MiB of 1-byte rows")
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
