"""What shardckpt.Error says to a Python caller: the Python API's names, never the C++ API's
(AsyncSave::wait_staged(), SaverOptions, a CopyEngine), and a failure of every rank of a job said
once in the message every rank gets, not once per rank."""
import os
import shutil
import tempfile
import unittest

import torch

import shardckpt as sc
from support import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
CPP_NAMES = ("::", "CopyEngine", "SaverOptions", "MPI or thread group")


class SoloGroup:
    """One process as a Python group that cannot run a save in the background (as NCCL's)."""
    def rank(self): return 0
    def size(self): return 1
    def barrier(self): pass
    def split(self, color, key): return self
    def all_gather_rows(self, rows, counts): pass
    def device_index(self): return -1
    def supports_background(self): return False
    def broadcast_bytes(self, data, root): return data
    def all_gather_bytes(self, data): return [data]


class Messages(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-messages-")
        self.path = os.path.join(self.dir, "a.h5")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def assert_python_words(self, text):
        for name in CPP_NAMES:
            self.assertNotIn(name, text)

    def test_a_group_without_background_saves_is_told_what_to_call_in_python(self):
        state = sc.StateDict()
        state.add(sc.ShardedParam(sc.ParamSpec("w", sc.plain_sections(4), [3]), 1, 0, 0, 0, shard=torch.zeros(4, 3)))
        with self.assertRaises(sc.Error) as e:
            sc.Saver(SoloGroup()).save_async(state, self.path)
        self.assertIn("Saver.save()", str(e.exception))
        self.assert_python_words(str(e.exception))

    def test_the_library_words_a_python_caller_can_meet_are_the_python_apis(self):
        for cpp, python in [
                ("key w: an async save of cuda:0 memory needs a Saver with that device's CopyEngine",
                 "Saver(cuda_device=N)"),
                ("device 0 memory: this shardckpt has no engine for devices (built without CUDA): give the save or "
                 "load a StagingPool of a CopyEngine of yours", "install a shardckpt built with CUDA"),
                ("until AsyncSave::wait_staged() returns (SaverOptions::check_unchanged)", "AsyncSave.wait_staged()")]:
            said = sc._core._python_wording(cpp)
            self.assertIn(python, said)
            self.assert_python_words(said)

    def test_a_failure_of_every_rank_is_said_once(self):
        results = run_ranks(4, os.path.join(HERE, "messages_worker.py"), self.path)
        last = [text.strip().splitlines()[-1] for _, text in results]
        self.assertEqual(len(set(last)), 1, last)  # every rank gets the same error
        said = last[0]
        self.assertTrue(said.startswith("ERROR shape_mismatch: loading "), said)
        self.assertIn(" failed on ranks 0-3: key decoder.layers.0.self_attention.linear_proj.weight: the checkpoint "
                      "holds global shape [16, 32] but parameter decoder.layers.0.self_attention.linear_proj.weight "
                      "(TP rank 0, GTP rank 0) expects [16, 64] (in rank 0's words; ranks 1-3 said the same of their "
                      "own numbers)", said)
        self.assertEqual(said.count("the checkpoint holds"), 1, said)


if __name__ == "__main__":
    unittest.main()
