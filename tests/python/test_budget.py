"""Saver(async_host_bytes=...) is checked against what this process can have when the saver is made:
a budget beyond physical memory (locking it would take the machine's memory page by page until the
OOM killer came) or beyond RLIMIT_AS is shardckpt.Error "resources" naming the budget and the limit;
one the address space left cannot map fails on "resources" at the save that allocates it, not
"internal"; a number that is no byte count (negative, 2**64 or more) is a ValueError naming it."""
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

import shardckpt as sc

PHYSICAL = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Budget(unittest.TestCase):
    def refused(self, budget, limit_text):
        start = time.time()
        with self.assertRaises(sc.Error) as e:
            sc.Saver(async_host_bytes=budget)
        self.assertEqual(e.exception.code, "resources", e.exception)
        self.assertIn(f"budget of {budget} bytes", str(e.exception))
        self.assertIn(limit_text, str(e.exception))
        self.assertLess(time.time() - start, 2)  # refused before anything was mapped

    def test_a_budget_beyond_physical_memory_is_refused_when_the_saver_is_made(self):
        for budget in (PHYSICAL + 1, 1 << 40, 2**64 - 1):
            self.refused(budget, f"{PHYSICAL} bytes of this machine's physical memory")
        self.assertEqual(sc.Saver(async_host_bytes=1 << 20).async_host_bytes(), 128 << 20)  # the pool's, at least

    def test_what_is_no_byte_count_is_a_value_error_naming_it(self):
        for name, value in (("async_host_bytes", -1), ("async_host_bytes", 2**64), ("staging_buffer_bytes", -5)):
            with self.assertRaises(ValueError) as e:
                sc.Saver(**{name: value})
            self.assertIn(f"{name} {value}: a number of bytes is 0 to 2**64 - 1", str(e.exception))

    def test_under_an_address_space_limit_the_error_is_resources(self):
        with tempfile.TemporaryDirectory(prefix="sc-budget-") as d:
            p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
                import os, resource, sys
                import torch
                import shardckpt as sc
                page = os.sysconf("SC_PAGE_SIZE")
                with open("/proc/self/statm") as f:
                    mapped = int(f.read().split()[0]) * page
                limit = mapped + (256 << 20)
                resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
                try:
                    sc.Saver(async_host_bytes=limit + 1)
                    raise AssertionError("a budget beyond RLIMIT_AS was taken")
                except sc.Error as e:
                    assert e.code == "resources" and f"RLIMIT_AS (address space) limit of {limit} bytes" in str(e), e
                # Under the limit, beyond the address space left: the saver that maps it fails, when it
                # is made, or (reserve=False) at the first save staged whole.
                try:
                    sc.Saver(async_host_bytes=limit - (16 << 20))
                    raise AssertionError("a budget beyond the address space left was mapped")
                except sc.Error as e:
                    assert e.code == "resources" and "could not be allocated" in str(e), (e.code, str(e))
                saver = sc.Saver(async_host_bytes=limit - (16 << 20), reserve=False)
                s = sc.StateDict()
                s.add(sc.ShardedTensor("t", torch.zeros(4, 4), [4, 4], [0, 0]))
                try:
                    saver.save_async(s, os.path.join(sys.argv[1], "a.h5")).wait()
                    raise AssertionError("a budget beyond the address space left was mapped")
                except sc.Error as e:
                    assert e.code == "resources" and "could not be allocated" in str(e), (e.code, str(e))
                print("resources three times")
            """), d], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, f"exit status {p.returncode}:\n{p.stdout}\n{p.stderr}")
        self.assertIn("resources three times", p.stdout)


if __name__ == "__main__":
    unittest.main()
