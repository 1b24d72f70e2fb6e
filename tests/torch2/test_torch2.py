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
from support import GlooJobCase, check_copy_back, check_example, copy_back_case, record_library_tensors  # noqa: E402

import shardckpt as sc  # noqa: E402

WORLD = 4
WORKER = os.path.join(os.path.dirname(__file__), "worker.py")
CASES = ["dtensor_save_state_dict", "dtensor_dcp", "dcp_async", "adam_plain", "adam_dtensor",
         "native_through_reader", "torch_sharded_tensor", "bad_input"]


def reader_round_trip(case, device):
    """(saved, targets, given): copy_back_case's state saved through the DCP Writer and loaded through
    the Reader into its targets on `device`, and the tensors the adapter handed the library for that
    load."""
    import torch.distributed.checkpoint as dcp
    from shardckpt.dcp import Reader, Writer
    saved, target = copy_back_case(device)
    given = record_library_tensors(case)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.h5")
        dcp.save(saved, storage_writer=Writer(path))
        given.clear()
        dcp.load(target, storage_reader=Reader(path))
    return saved, target, given


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

    def test_hostile_dcp_common_values_bytes_items_and_disagreeing_ranks_are_typed_errors(self):
        import torch.distributed.checkpoint as dcp
        from shardckpt.dcp import BYTES_KEY, PLANNER_DATA_KEY, Reader, Writer
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "h.h5")
            deep = "[" * 100000 + "]" * 100000
            for key, value in ((BYTES_KEY, deep), (PLANNER_DATA_KEY, deep), (BYTES_KEY, "7"),
                               (PLANNER_DATA_KEY, '{"a": 3}')):
                with self.subTest(key=key, value=value[:8]):
                    state = sc.StateDict()
                    state.add(sc.ShardedTensor("w", torch.ones(2), [2], [0]))
                    state.add_common(key, value)
                    sc.save(state, path)
                    with self.assertRaises(sc.Error) as c:
                        Reader(path).read_metadata()
                    self.assertIn(path, str(c.exception))
                    self.assertIn(key, str(c.exception))
            # bytes_items=False: DCP never gets a bytes item to unpickle.
            dcp.save({"w": torch.ones(2), "opt": {"param_groups": [{"lr": 0.1}]}}, storage_writer=Writer(path))
            with self.assertRaises(BaseException) as c:
                dcp.load({"w": torch.zeros(2), "opt": {"param_groups": [{"lr": 0.0}]}},
                         storage_reader=Reader(path, bytes_items=False))
            self.assertIn("bytes_items=False", str(c.exception))
            target = {"w": torch.zeros(2)}
            dcp.load(target, storage_reader=Reader(path, bytes_items=False))  # tensors alone load
            self.assertTrue(torch.equal(target["w"], torch.ones(2)))
            # Ranks whose read_metadata read different checkpoints: the coordinator refuses the plan.
            from torch.distributed.checkpoint.planner import LoadPlan
            r = Reader(path)
            r.read_metadata()
            plans = [r.prepare_local_plan(LoadPlan([])) for _ in range(2)]
            self.assertEqual(r.prepare_global_plan(plans), plans)
            other = Reader(os.path.join(d, "other.h5"))
            dcp.save({"w": torch.ones(2)}, storage_writer=Writer(other.path))
            other.read_metadata()
            with self.assertRaises(sc.Error) as c:
                r.prepare_global_plan([plans[0], other.prepare_local_plan(LoadPlan([]))])
            self.assertIn("different checkpoints", str(c.exception))

    def test_bool_0d_and_int64_tensors_cross_front_ends(self):
        """A bool tensor (and a 0-d one, int64 ones) saved by save_state_dict comes back as bool through
        the DCP Reader, and one saved through the DCP Writer as bool through load_state_dict: both
        record it in the common value shardckpt.dtypes."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict_loader
        from shardckpt.dcp import Reader, Writer
        state = {"mask": torch.tensor([True, False, True]), "flag": torch.tensor(True), "step": torch.tensor(3),
                 "ids": torch.arange(4, dtype=torch.int64) - 1, "w": torch.ones(2, 3, dtype=torch.bfloat16)}
        with tempfile.TemporaryDirectory() as d:
            by_tree, by_dcp = os.path.join(d, "tree.h5"), os.path.join(d, "dcp.h5")
            sc.save_state_dict(state, by_tree)
            dcp.save(state, storage_writer=Writer(by_dcp))
            for path in (by_tree, by_dcp):
                with self.subTest(saved=os.path.basename(path)):
                    common = sc.inspect(path)["common"]
                    self.assertEqual(json.loads(common["shardckpt.dtypes"]), {"flag": "bool", "mask": "bool"})
                    meta = Reader(path).read_metadata().state_dict_metadata
                    self.assertEqual({k: meta[k].properties.dtype for k in state},
                                     {k: v.dtype for k, v in state.items()})
                    loads = {"dcp.load": lambda t: dcp.load(t, storage_reader=Reader(path)),
                             "load_state_dict": lambda t: sc.load_state_dict(t, path)}
                    for how, load in loads.items():
                        target = {k: torch.zeros_like(v) for k, v in state.items()}
                        load(target)
                        for k, v in state.items():
                            self.assertEqual(target[k].dtype, v.dtype, f"{how} {k}")
                            self.assertTrue(torch.equal(target[k], v), f"{how} {k}")
                    # Tensors DCP allocates itself from the Reader's metadata: a bool one is bool.
                    got = state_dict_loader._load_state_dict_from_keys(set(state), storage_reader=Reader(path))
                    for k, v in state.items():
                        self.assertEqual(got[k].dtype, v.dtype, k)
                        self.assertTrue(torch.equal(got[k], v), k)
            # The state dict's tree, read back without targets: the bool tensors are bool.
            loaded = sc.load_state_dict({}, by_tree)
            self.assertEqual({k: v.dtype for k, v in loaded.items()}, {k: v.dtype for k, v in state.items()})

    def test_reader_fills_contiguous_targets_in_place_and_others_through_temporaries(self):
        saved, target, given = reader_round_trip(self, "cpu")
        check_copy_back(self, saved, target, given)
        self.assertEqual(target["wide"].dtype, torch.float64)
        self.assertEqual(sorted(str(t.dtype) for t in given if t.data_ptr() not in
                                {target[k].data_ptr() for k in target}), ["torch.float32", "torch.float32"])

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


@unittest.skipUnless(torch.cuda.is_available(), "torch has no CUDA device here")
class CudaOneProcess(unittest.TestCase):
    def test_reader_fills_cuda_targets_on_their_device(self):
        """The Reader hands the library CUDA memory only: a contiguous target of the stored dtype itself
        (the library's device path), any other through a temporary on the target's device."""
        saved, target, given = reader_round_trip(self, "cuda")
        self.assertEqual([t.device.type for t in given], ["cuda"] * len(saved))
        check_copy_back(self, saved, target, given)


if __name__ == "__main__":
    unittest.main()
