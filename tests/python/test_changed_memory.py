"""Python code may change a tensor's memory after it was added to a state dict: torch's resize_
reallocates (and frees) it, a storage resized to 0 frees it as FSDP frees a parameter's, set_ points
the tensor elsewhere, numpy's resize(refcheck=False) reallocates. A save or load then uses the memory
the tensor has when it begins (taken again, with the GIL, from the tensor), or refuses naming the
key; an async save never reads host memory after save_async returns. Each case runs in its own
process: the failure it guards against is a segfault, or freed bytes saved with matching checksums."""
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

PRELUDE = """
import faulthandler, os, sys
faulthandler.enable()
import numpy as np
import torch
import shardckpt as sc
path = sys.argv[1]
good = path + ".good.h5"  # a checkpoint of the tensors as they were, to load from
storage = lambda t: t.untyped_storage() if hasattr(t, "untyped_storage") else t._storage()  # torch 1.13: _storage

def state_of(t, key="big"):
    s = sc.StateDict()
    s.add(sc.ShardedParam(sc.ParamSpec(key, sc.plain_sections(t.shape[0]), list(t.shape[1:])), 1, 0, 0, 0, shard=t))
    return s

def refused(f, code):
    try:
        f()
    except sc.Error as e:
        assert e.code == code, (e.code, str(e))
        assert "big" in str(e), str(e)
        assert not os.path.exists(path), "a refused save wrote a file"
        print("refused:", e)
        return
    raise AssertionError("not refused")
"""


class ChangedMemory(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-changed-")
        self.path = os.path.join(self.dir, "a.h5")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_case(self, body):
        """Runs `body` after PRELUDE in a fresh interpreter; returns its output, or fails on a signal or error."""
        p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), self.path], capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(p.returncode, 0, f"exit status {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p.stdout

    def test_a_storage_freed_under_its_tensor_is_refused_before_anything_is_written(self):
        out = self.run_case("""
            t = torch.rand(1024, 4096)  # 16 MiB: mapped pages, unmapped when freed
            s = state_of(t)
            sc.save(s, good)
            storage(t).resize_(0)  # as FSDP frees a parameter
            refused(lambda: sc.save(s, path), "shard_changed")
            refused(lambda: sc.Saver().save(s, path), "shard_changed")
            refused(lambda: sc.Saver().save_async(s, path).wait(), "shard_changed")
            refused(lambda: sc.load_into(good, s), "shard_changed")  # nothing written into freed memory
        """)
        self.assertEqual(out.count("refused:"), 4, out)
        self.assertIn("big: ", out)

    def test_a_tensor_resized_is_refused_by_the_shape_it_has_now(self):
        out = self.run_case("""
            t = torch.rand(10, 8)
            s = state_of(t)
            t.resize_(1000, 8)  # reallocated: the memory taken at add is freed
            refused(lambda: sc.save(s, path), "shape_mismatch")
            a = np.zeros((10, 8), np.float32)
            s = state_of(a)
            sc.save(s, good)
            a.resize((1000, 8), refcheck=False)  # numpy reallocates too
            refused(lambda: sc.save(s, path), "shape_mismatch")
            refused(lambda: sc.load_into(good, s), "shape_mismatch")
        """)
        self.assertEqual(out.count("refused:"), 3, out)
        self.assertIn("the shard has shape [1000, 8]", out)

    def test_memory_given_back_to_a_tensor_is_what_is_saved(self):
        self.run_case("""
            t = torch.zeros(64, 8)
            s = state_of(t)
            storage(t).resize_(0)  # freed after a forward, as FSDP does ...
            storage(t).resize_(64 * 8 * 4)  # ... and given back before the next one
            t.copy_(torch.arange(64 * 8.0).view(64, 8))
            sc.save(s, path)
            assert torch.equal(sc.read(path)["big"], t), "not the tensor's memory of now"
            other = torch.full((64, 8), 3.0)
            t.set_(other)  # the tensor now views another storage
            sc.save(s, path)
            assert torch.equal(sc.read(path)["big"], other)
            t.fill_(0)
            sc.load_into(path, s)
            assert torch.equal(other, torch.full((64, 8), 3.0))
        """)

    def test_a_tensor_resized_during_an_async_save_leaves_its_checkpoint_whole(self):
        for check in (False, True):
            out = self.run_case(f"""
                t = torch.rand(1024, 4096)  # 16 MiB through a budget of 2 MiB: streamed
                before = t.clone()
                s = state_of(t)
                saver = sc.Saver(staging_buffer_bytes=1 << 20, check_unchanged={check})
                pending = saver.save_async(s, path)
                t.resize_(4096, 4096)  # the 16 MiB the save streams are freed (unmapped)
                storage(t).resize_(0)
                pending.wait()
                assert torch.equal(sc.read(path)["big"], before), "the checkpoint is not the tensor at save_async"
                print("whole")
            """)
            self.assertIn("whole", out)

    def test_a_tensor_written_by_another_thread_during_a_save_fails_it_or_is_saved_whole(self):
        # Another thread of the caller adds to the tensor while the save writes it (the save holds no
        # GIL). Every row's checksum is taken before and after its write: a save that saw a row change
        # fails with shard_changed naming the key and the row, and commits nothing; a save that
        # commits holds checksums of the very bytes in its file. With a checksum taken once, of bytes
        # read again for the write (or saved from a copy the checksums describe), no save would fail.
        out = self.run_case("""
            import threading
            t = torch.zeros(2048, 4096)  # 32 MiB
            s = state_of(t)
            sc.save(s, path)
            stop = threading.Event()
            def mutate():
                while not stop.is_set():
                    t.add_(1.0)
            mutator = threading.Thread(target=mutate)
            mutator.start()
            failed = committed = 0
            try:
                # Whether the mutator runs while the rows are written is the scheduler's say: the
                # saves go on until one has seen a change (at least 8, at most 30).
                for attempt in range(30):
                    if attempt >= 8 and failed:
                        break
                    before = os.stat(path).st_ino
                    try:
                        sc.save(s, path)
                        committed += 1
                    except sc.Error as e:
                        assert e.code == "shard_changed", (e.code, str(e))
                        assert "key big: row " in str(e) and "changed while the save wrote it" in str(e), str(e)
                        assert os.stat(path).st_ino == before, "a failed save replaced the checkpoint"
                        failed += 1
                    report = sc.verify(path)
                    assert report["mismatches"] == 0, report
            finally:
                stop.set()
                mutator.join()
            left = [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".partial")]
            assert not left, f"a temporary file stayed: {left}"
            print("failed", failed, "committed", committed, flush=True)
            assert failed > 0, "no save saw the tensor change under it"
        """)
        self.assertIn("failed ", out)


if __name__ == "__main__":
    unittest.main()
