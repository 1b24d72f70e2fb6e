"""0-d tensors (BatchNorm's num_batches_tracked, Adam's step) through the Python package: saved as
scalar datasets (h5py reads shape ()), loaded back as 0-d tensors, listed by inspect with global
shape (); and a DTensor where a plain tensor is expected is a TypeError that says what to do."""
import os
import shutil
import tempfile
import unittest

import h5py
import numpy as np
import torch

import shardckpt as sc

SCALARS = {
    "bn.num_batches_tracked": torch.tensor(3, dtype=torch.int64),
    "opt.step": torch.tensor(0.5),
    "opt.step_bf16": torch.tensor(0.5, dtype=torch.bfloat16),
    "opt.large": torch.tensor(2**40 + 1, dtype=torch.int64),
}


class FakeDTensor:
    """What shardckpt knows a DTensor by (Debian's torch 1.13 has none): to_local, placements and a
    device mesh."""
    placements = ()
    device_mesh = None

    def to_local(self):
        return torch.zeros(2)


class Scalars(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-scalars-")
        self.path = os.path.join(self.dir, "s.h5")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def save(self, method="raw"):
        state = sc.StateDict()
        for key, value in SCALARS.items():
            state.add(sc.ShardedTensor(key, value, global_shape=[], global_offset=[]))
        state.add(sc.ShardedTensor("weight", torch.arange(6.0).reshape(2, 3), [2, 3], [0, 0]))
        sc.save(state, self.path, method=method)

    def request(self):
        req = sc.StateDict()
        for key, value in SCALARS.items():
            req.add(sc.ShardedTensor.expect(key, value.dtype, shape=[], global_shape=[], global_offset=[]))
        return req

    def test_round_trip_as_0d_tensors_through_either_method(self):
        for saved in ("raw", "hyperslab"):
            self.save(saved)
            for method in ("raw", "hyperslab"):
                got = sc.load(self.path, self.request(), method=method)
                for key, value in SCALARS.items():
                    self.assertEqual(got[key].shape, torch.Size([]), (saved, method, key))
                    self.assertEqual(got[key].dtype, value.dtype, key)
                    self.assertTrue(torch.equal(got[key], value), (saved, method, key, got[key]))
            self.assertEqual(sc.verify(self.path)["mismatches"], 0)

    def test_h5py_reads_shape_and_value(self):
        self.save()
        with h5py.File(self.path, "r") as f:
            for key, value in SCALARS.items():
                self.assertEqual(f[key].shape, (), key)
                self.assertEqual(f[key][()], value.item(), key)  # the library's bf16 reads as float32
            self.assertEqual(f["bn.num_batches_tracked"].dtype, np.int64)
            self.assertEqual(f["opt.step_bf16"].dtype, np.float32)
            self.assertEqual(f["weight"].shape, (2, 3))

    def test_inspect_lists_global_shape_empty(self):
        self.save()
        shapes = {t["key"]: t["global_shape"] for t in sc.inspect(self.path)["tensors"]}
        for key in SCALARS:
            self.assertEqual(shapes[key], (), key)
        self.assertEqual(shapes["weight"], (2, 3))
        self.assertEqual(sc.read(self.path)["opt.step"].shape, torch.Size([]))

    def test_load_into_fills_a_0d_tensor_in_place(self):
        self.save()
        into = {key: torch.zeros((), dtype=value.dtype) for key, value in SCALARS.items()}
        state = sc.StateDict()
        for key, t in into.items():
            state.add(sc.ShardedTensor(key, t, [], []))
        addresses = {key: t.data_ptr() for key, t in into.items()}
        sc.load_into(self.path, state)
        for key, value in SCALARS.items():
            self.assertTrue(torch.equal(into[key], value), key)
            self.assertEqual(into[key].data_ptr(), addresses[key])
        # numpy's 0-d arrays too
        n = np.zeros((), dtype=np.int64)
        s = sc.StateDict()
        s.add(sc.ShardedTensor("bn.num_batches_tracked", n, [], []))
        sc.load_into(self.path, s)
        self.assertEqual(int(n), 3)

    def test_a_request_of_another_shape_is_a_shape_mismatch_naming_both(self):
        self.save()
        req = sc.StateDict()
        req.add(sc.ShardedTensor.expect("opt.step", torch.float32, [1], [1], [0]))
        with self.assertRaises(sc.Error) as e:
            sc.load(self.path, req)
        self.assertEqual(e.exception.code, "shape_mismatch")
        self.assertIn("key opt.step: the checkpoint holds global shape [] but tensor opt.step expects [1]",
                      str(e.exception))
        req = sc.StateDict()
        req.add(sc.ShardedTensor.expect("weight", torch.float32, [], [], []))
        with self.assertRaises(sc.Error) as e:
            sc.load(self.path, req)
        self.assertEqual(e.exception.code, "shape_mismatch")
        self.assertIn("key weight: the checkpoint holds global shape [2, 3] but tensor weight expects []",
                      str(e.exception))

    def test_a_dtensor_is_a_type_error_that_says_what_to_do(self):
        with self.assertRaises(TypeError) as e:
            sc.ShardedTensor("w", FakeDTensor(), [4], [0])
        text = str(e.exception)
        self.assertIn("key w: a DTensor", text)
        self.assertIn("t.to_local()", text)
        self.assertIn("save_state_dict", text)
        with self.assertRaises(TypeError) as e:
            sc.ShardedParam(sc.ParamSpec("p", sc.plain_sections(4), [2]), 1, 0, 0, 0, shard=FakeDTensor())
        self.assertIn("key p: a DTensor", str(e.exception))


if __name__ == "__main__":
    unittest.main()
