"""torch 2.x (PyPI) on CPU under gloo: shardckpt.save_state_dict / load_state_dict and shardckpt.dcp's
Writer and Reader under torch.distributed.checkpoint, on 4 processes (tests/torch2/worker.py runs
every case in one job; each test here checks its case on every rank)."""
import json
import os
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from support import GlooJobCase, check_example  # noqa: E402

import shardckpt as sc  # noqa: E402

WORLD = 4
WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
CASES = ["dtensor_save_state_dict", "dtensor_dcp", "dcp_async", "adam_plain", "adam_dtensor",
         "native_through_reader", "torch_sharded_tensor", "bad_input"]


class Torch2Job(GlooJobCase, unittest.TestCase):
    WORLD, WORKER, CASES = WORLD, WORKER, CASES

    def test_dtensors_save_state_dict_load_at_other_meshes_and_placements(self):
        self.check("dtensor_save_state_dict")

    def test_dtensors_dcp_save_and_load_with_writer_and_reader(self):
        self.check("dtensor_dcp")

    def test_dcp_async_save(self):
        self.check("dcp_async")

    def test_module_and_adam_resume_from_state_dict_and_dcp(self):
        self.check("adam_plain")

    def test_tensor_parallel_module_and_adam_through_get_and_set_state_dict(self):
        self.check("adam_dtensor")

    def test_native_gtp_checkpoint_through_the_reader(self):
        self.check("native_through_reader")

    def test_torch_sharded_tensor(self):
        self.check("torch_sharded_tensor")

    def test_bad_input_raises_on_every_rank(self):
        self.check("bad_input")


class Examples(unittest.TestCase):
    def test_dcp_storage_example_on_four_processes(self):
        check_example(self, "dcp_storage.py", "0.weight (16, 8) in h5py, resumed", WORLD)


class OneProcess(unittest.TestCase):
    """Without torch.distributed: one process, no group."""

    def test_state_dict_two_lines(self):
        model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
        model(torch.randn(4, 3))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "m.h5")
            sc.save_state_dict(model.state_dict(), path)
            other = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5))
            sc.load_state_dict(other.state_dict(), path)
            for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
                self.assertTrue(torch.equal(a, b), k)
            info = sc.inspect(path)
            shapes = {t["key"]: tuple(t["global_shape"]) for t in info["tensors"]}
            self.assertEqual(shapes["1.num_batches_tracked"], ())
            self.assertEqual(shapes["0.weight"], (5, 3))

    def test_dcp_without_a_process_group(self):
        import torch.distributed.checkpoint as dcp
        from shardckpt.dcp import Reader, Writer
        state = {"a": torch.arange(12.0).reshape(3, 4), "b": {"c": torch.ones(2, dtype=torch.bfloat16)}, "n": 5}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "one.h5")
            dcp.save(state, storage_writer=Writer(path))
            target = {"a": torch.zeros(3, 4), "b": {"c": torch.zeros(2, dtype=torch.bfloat16)}, "n": 0}
            dcp.load(target, storage_reader=Reader(path))
            self.assertTrue(torch.equal(target["a"], state["a"]))
            self.assertTrue(torch.equal(target["b"]["c"], state["b"]["c"]))
            self.assertEqual(target["n"], 5)
            info = sc.inspect(path)
            self.assertEqual({t["key"]: t["dtype"] for t in info["tensors"]}["b.c"], "bf16")
            self.assertIn("n", json.loads(info["common"][sc.dcp.BYTES_KEY]))

    def test_reader_reads_an_adopted_safetensors_file(self):
        import subprocess
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file
        from shardckpt.dcp import Reader
        tool = os.path.join(sys.prefix, "bin", "shardckpt")  # installed beside the package by pip
        weights = {"embed.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4),
                   "norm.weight": torch.ones(4, dtype=torch.bfloat16) * 3}
        with tempfile.TemporaryDirectory() as d:
            source, records = os.path.join(d, "m.safetensors"), os.path.join(d, "records.json")
            save_file(weights, source)
            with open(records, "w") as f:
                f.write("[]")
            out = os.path.join(d, "m.h5")
            subprocess.run([tool, "adopt", source, "--model-config", records, "--out", out], check=True,
                           capture_output=True)
            target = {k: torch.zeros_like(v) for k, v in weights.items()}
            dcp.load(target, storage_reader=Reader(out))
            for k, v in weights.items():
                self.assertTrue(torch.equal(target[k], v), k)


if __name__ == "__main__":
    unittest.main()
