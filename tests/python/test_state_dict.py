"""shardckpt.save_state_dict / load_state_dict on one process with Debian's torch 1.13: every kind
of leaf comes back with its type, tensors are filled in place, what cannot be saved is refused
before anything is written (the multi-process, DTensor and DCP cases run under torch 2.x:
tests/torch2)."""
import os
import tempfile
import unittest

import h5py
import torch

import shardckpt as sc


class StateDictOneProcess(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "sd.h5")

    def tearDown(self):
        self.tmp.cleanup()

    def test_every_leaf_comes_back_with_its_type(self):
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        state = {"model": {"layer.weight": w, "steps": torch.tensor(7), "scale": torch.tensor(0.25, dtype=torch.bfloat16),
                           "mask": torch.tensor([True, False, True])},
                 "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": w * 2}},
                           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "nesterov": False,
                                             "foreach": None, "name": "all"}]},
                 "epoch": 2, "items": [torch.ones(2), 5]}
        sc.save_state_dict(state, self.path)
        with h5py.File(self.path, "r") as f:
            self.assertEqual(f["model.layer.weight"].shape, (3, 4))
            self.assertEqual(f["model.steps"].shape, ())
            self.assertEqual(int(f["model.steps"][()]), 7)
            self.assertEqual(float(f["model.scale"][()]), 0.25)
            self.assertEqual(f["optim.state.0.step"].shape, ())
            self.assertEqual(f["items.0"].shape, (2,))
        target = {"model": {"layer.weight": torch.zeros(3, 4), "steps": torch.tensor(0), "mask": torch.zeros(3, dtype=torch.bool),
                            "scale": torch.tensor(0.0, dtype=torch.bfloat16)},
                  "optim": {"state": {}, "param_groups": [{}]}}
        kept = target["model"]["layer.weight"]
        loaded = sc.load_state_dict(target, self.path)
        self.assertIs(loaded["model"]["layer.weight"], kept)  # filled in place
        self.assertTrue(torch.equal(kept, w))
        self.assertEqual(int(target["model"]["steps"]), 7)
        self.assertTrue(torch.equal(target["model"]["mask"], torch.tensor([True, False, True])))
        self.assertEqual(float(target["model"]["scale"]), 0.25)
        # What the target lacks comes back new, at its saved dtype and shape.
        step = loaded["optim"]["state"][0]["step"]
        self.assertEqual((step.dtype, step.shape, float(step)), (torch.float32, torch.Size([]), 3.0))
        self.assertTrue(torch.equal(loaded["optim"]["state"][0]["exp_avg"], w * 2))
        group = loaded["optim"]["param_groups"][0]
        self.assertEqual(group, {"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "nesterov": False, "foreach": None,
                                 "name": "all"})
        self.assertIsInstance(group["betas"], tuple)
        self.assertIs(group["nesterov"], False)
        self.assertIsInstance(loaded["epoch"], int)
        self.assertEqual(loaded["items"][1], 5)
        self.assertIn(0, loaded["optim"]["state"])  # an int key stays an int

    def test_non_contiguous_tensors_save_and_fill(self):
        w = torch.arange(12.0).reshape(3, 4)
        sc.save_state_dict({"t": w.t()}, self.path)
        with h5py.File(self.path, "r") as f:
            self.assertEqual(f["t"].shape, (4, 3))
            self.assertTrue((torch.from_numpy(f["t"][()]) == w.t()).all())
        base = torch.zeros(3, 4)
        sc.load_state_dict({"t": base.t()}, self.path)
        self.assertTrue(torch.equal(base, w))

    def test_a_module_and_its_optimizer_resume(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(5, 3)).sum().backward()
            opt.step()
        sc.save_state_dict({"model": model.state_dict(), "optim": opt.state_dict()}, self.path)
        model2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
        loaded = sc.load_state_dict({"model": model2.state_dict(), "optim": opt2.state_dict()}, self.path)
        opt2.load_state_dict(loaded["optim"])
        for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            self.assertTrue(torch.equal(a, b), k)
        self.assertEqual(opt2.state_dict()["param_groups"][0]["lr"], 0.01)
        for pid, s in opt.state_dict()["state"].items():
            for name, v in s.items():
                self.assertTrue(torch.equal(torch.as_tensor(v), torch.as_tensor(opt2.state_dict()["state"][pid][name])),
                                f"{pid}.{name}")

    def assert_refused(self, state, kind, *needles):
        with self.assertRaises(kind) as c:
            sc.save_state_dict(state, self.path)
        for n in needles:
            self.assertIn(n, str(c.exception))
        self.assertFalse(os.path.exists(self.path), "a refused state dict left a file")

    def test_what_cannot_be_saved_is_refused_before_anything_is_written(self):
        class Opaque:
            pass
        self.assert_refused({"a": {"b": [torch.ones(1), Opaque()]}}, TypeError, "a.b.1", "Opaque")
        self.assert_refused({"z": torch.zeros(2, dtype=torch.complex64)}, TypeError, "z", "complex64")
        self.assert_refused({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, ValueError, "'a.b'")
        self.assert_refused({"a": {(1, 2): torch.ones(1)}}, TypeError, "tuple")
        self.assert_refused({"n": 2**70}, ValueError, "n", "int64")
        self.assert_refused([torch.ones(1)], TypeError, "list")

    def test_a_load_checks_keys_and_shapes(self):
        sc.save_state_dict({"w": torch.ones(4, 2)}, self.path)
        with self.assertRaises(KeyError) as c:
            sc.load_state_dict({"w": torch.ones(4, 2), "v": torch.ones(1)}, self.path)
        self.assertIn("v", str(c.exception))
        self.assertIn(self.path, str(c.exception))
        with self.assertRaises(ValueError) as c:
            sc.load_state_dict({"w": torch.ones(4, 3)}, self.path)
        self.assertIn("(4, 3)", str(c.exception))
        self.assertIn("(4, 2)", str(c.exception))

    def test_a_checkpoint_without_a_structure_loads_by_keys(self):
        # A native checkpoint (shardckpt.save of ShardedTensors and common values): tensors by key.
        state = sc.StateDict()
        w = torch.arange(6.0).reshape(2, 3)
        state.add(sc.ShardedTensor("layer.weight", w, [2, 3], [0, 0]))
        state.add_common("step", 11)
        sc.save(state, self.path)
        target = {"layer": {"weight": torch.zeros(2, 3)}, "step": 0}
        loaded = sc.load_state_dict(target, self.path)
        self.assertTrue(torch.equal(target["layer"]["weight"], w))
        self.assertEqual(loaded["step"], 11)


    def test_bool_0d_and_int64_tensors_and_the_dtypes_record(self):
        """bool tensors are stored as uint8 bytes and recorded in the common value shardckpt.dtypes (only
        them); a load reads a dataset's dtype from that record, from the older tree record ("dtype" in
        a tensor node) when the file has no shardckpt.dtypes, else the dataset's own."""
        import json
        state = {"mask": torch.tensor([True, False, True]), "flag": torch.tensor(True), "n": torch.tensor(7),
                 "ids": torch.arange(5, dtype=torch.int64) - 2}
        sc.save_state_dict(state, self.path)
        common = sc.inspect(self.path)["common"]
        self.assertEqual(json.loads(common["shardckpt.dtypes"]), {"flag": "bool", "mask": "bool"})
        with h5py.File(self.path, "r") as f:
            self.assertEqual((f["mask"].dtype.name, f["flag"].shape, f["n"].shape), ("uint8", (), ()))
        loaded = sc.load_state_dict({}, self.path)  # every tensor new, at its recorded dtype
        for k, v in state.items():
            self.assertEqual((loaded[k].dtype, loaded[k].shape), (v.dtype, v.shape), k)
            self.assertTrue(torch.equal(loaded[k], v), k)
        # A native checkpoint whose only record is shardckpt.dtypes, and one whose only record is the tree's.
        for records in ({"shardckpt.dtypes": '{"m": "bool"}'},
                        {sc.state_dict.STRUCTURE_KEY: '{"format": 1, "tree": {"dict": [["m", {"tensor": "m", '
                                                      '"dtype": "bool"}]]}}'},
                        {sc.state_dict.STRUCTURE_KEY: '{"format": 1, "tree": {"dict": [["m", {"tensor": "m"}]]}}',
                         "shardckpt.dtypes": '{"m": "bool"}'}):
            with self.subTest(records=sorted(records)):
                native = sc.StateDict()
                native.add(sc.ShardedTensor("m", torch.tensor([0, 1, 1], dtype=torch.uint8), [3], [0]))
                for k, v in records.items():
                    native.add_common(k, v)
                sc.save(native, self.path)
                if sc.state_dict.STRUCTURE_KEY in records:
                    got = sc.load_state_dict({}, self.path)["m"]
                    self.assertEqual(got.dtype, torch.bool)
                    self.assertTrue(torch.equal(got, torch.tensor([False, True, True])))
                target = torch.zeros(3, dtype=torch.bool)
                sc.load_state_dict({"m": target}, self.path)
                self.assertTrue(torch.equal(target, torch.tensor([False, True, True])))

    def test_a_hostile_dtypes_record_is_a_typed_error_naming_the_file(self):
        for value in ("7", '{"m": "float32"}', '{"m": ["bool"]}', '{"w": "bool"}', "[" * 100000 + "]" * 100000):
            with self.subTest(value=value[:20]):
                state = sc.StateDict()
                state.add(sc.ShardedTensor("w", torch.ones(2), [2], [0]))  # f32: not the bytes of a bool
                state.add_common("shardckpt.dtypes", value)
                sc.save(state, self.path)
                with self.assertRaises(sc.Error) as c:
                    sc.load_state_dict({"w": torch.zeros(2)}, self.path)
                self.assertIn(self.path, str(c.exception))
                self.assertIn("shardckpt.dtypes", str(c.exception))

    def test_targets_of_another_dtype_non_contiguous_or_sharing_bytes_load_through_temporaries(self):
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        sc.save_state_dict({"w": w, "v": w + 100, "b": torch.tensor([True, False])}, self.path)
        # Another dtype (f64 for f32, int for bool), not contiguous, and a second key into bytes the
        # first fills (tied weights): each through a temporary, copied back in order.
        wide, tied = torch.zeros(4, 3, dtype=torch.float64).t(), torch.zeros(3, 4)
        flags = torch.zeros(2, dtype=torch.int32)
        loaded = sc.load_state_dict({"w": wide, "v": tied, "b": flags}, self.path)
        self.assertIs(loaded["w"], wide)
        self.assertTrue(torch.equal(wide, w.double()))
        self.assertTrue(torch.equal(flags, torch.tensor([1, 0], dtype=torch.int32)))
        sc.load_state_dict({"w": tied, "v": tied}, self.path)
        self.assertTrue(torch.equal(tied, w + 100))  # the later key's bytes
        both = torch.zeros(5, 4)  # destinations that share some bytes: refused by name
        with self.assertRaises(sc.Error) as c:
            sc.load_state_dict({"w": both[:3], "v": both[2:]}, self.path)
        self.assertIn("share", str(c.exception))

    def test_tensors_without_plain_bytes_are_refused_by_key(self):
        sparse = torch.zeros(4, 4).to_sparse()
        self.assert_refused({"model": {"s": sparse}}, TypeError, "model.s", "layout")
        self.assert_refused({"m": torch.empty(3, device="meta")}, TypeError, "m", "meta")

    def hostile(self, value):
        """A checkpoint whose state dict structure is `value` (a JSON text), and one tensor."""
        state = sc.StateDict()
        state.add(sc.ShardedTensor("w", torch.ones(2), [2], [0]))
        state.add_common("step", 3)
        state.add_common(sc.state_dict.STRUCTURE_KEY, value)
        sc.save(state, self.path)

    def test_a_hostile_structure_is_a_typed_error_naming_the_file(self):
        deep = "[" * 100000 + "]" * 100000
        cases = {
            "a number": "1",
            "a tree that is a number": '{"format": 1, "tree": 7}',
            "JSON nested 100,000 deep": deep,
            "a tree nested 100,000 deep": '{"format": 1, "tree": {"dict": [["a", ' + '{"list": [' * 5000 + ']}' * 5000 + ']]}}',
            "a dtype torch lacks": '{"format": 1, "tree": {"dict": [["w", {"tensor": "w", "dtype": "no_such_dtype"}]]}}',
            "a tensor the file lacks": '{"format": 1, "tree": {"dict": [["v", {"tensor": "v"}]]}}',
            "a leaf of an unknown kind": '{"format": 1, "tree": {"dict": [["s", {"complex": "step"}]]}}',
            "an int leaf over a str": '{"format": 1, "tree": {"dict": [["s", {"str": "step"}]]}}',
            "a key that is a list": '{"format": 1, "tree": {"dict": [[["x"], {"none": null}]]}}',
        }
        for what, value in cases.items():
            with self.subTest(what):
                self.hostile(value)
                with self.assertRaises(sc.Error) as c:
                    sc.load_state_dict({"w": torch.zeros(2)}, self.path)
                self.assertIn(self.path, str(c.exception))
                self.assertIn(sc.state_dict.STRUCTURE_KEY, str(c.exception))

    def test_a_load_racing_saves_never_mixes_two_checkpoints(self):
        """One process saves {"w": full(g), "step": g} over and over; this one loads meanwhile: every
        load gives one save's step and tensor, never a mix; and since a load reads its tree, common
        values and tensors from one open file, none is refused as "replaced" either."""
        import subprocess
        import sys
        import time
        code = ("import sys, torch, shardckpt as sc\n"
                "g = 0\n"
                "while True:\n"
                "    g += 1\n"
                "    sc.save_state_dict({'model': {'w': torch.full((1024,), float(g))}, 'step': g}, sys.argv[1])\n"
                "    if g == 1:\n"
                "        print('saving', flush=True)\n")
        sc.save_state_dict({"model": {"w": torch.full((1024,), 0.0)}, "step": 0}, self.path)
        saver = subprocess.Popen([sys.executable, "-c", code, self.path], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
        loads = mixes = refused = 0
        try:
            self.assertEqual(saver.stdout.readline().strip(), "saving")
            end = time.monotonic() + 5
            while time.monotonic() < end:
                target = {"model": {"w": torch.zeros(1024)}, "step": -1}
                try:
                    got = sc.load_state_dict(target, self.path)
                except sc.Error as e:
                    self.assertIn("replaced", str(e))
                    refused += 1
                    continue
                loads += 1
                w = target["model"]["w"]
                if not (w == float(got["step"])).all():
                    mixes += 1
        finally:
            saver.kill()
            saver.wait()
        print(f"racing saves: {loads} loads, {refused} refused as replaced, {mixes} mixed", file=sys.stderr)
        self.assertEqual(mixes, 0, f"{mixes} of {loads} loads mixed two saves ({refused} refused)")
        self.assertEqual(refused, 0, f"{refused} loads were refused: a load opened the file more than once")
        self.assertGreater(loads, 20)

    def test_tensors_without_elements_are_datasets_of_their_shape(self):
        sd = {"z": torch.zeros(0), "e": torch.zeros(0, 4, dtype=torch.bfloat16), "w": torch.ones(2)}
        sc.save_state_dict(sd, self.path)
        shapes = {t["key"]: tuple(t["global_shape"]) for t in sc.inspect(self.path)["tensors"]}
        self.assertEqual(shapes, {"z": (0,), "e": (0, 4), "w": (2,)})
        got = sc.load_state_dict({}, self.path)
        self.assertEqual({k: tuple(v.shape) for k, v in got.items()}, {"z": (0,), "e": (0, 4), "w": (2,)})
        self.assertEqual(got["e"].dtype, torch.bfloat16)
        target = {"z": torch.ones(0), "e": torch.ones(0, 4, dtype=torch.bfloat16), "w": torch.zeros(2)}
        got = sc.load_state_dict(target, self.path)
        self.assertIs(got["e"], target["e"])
        self.assertTrue(torch.equal(target["w"], torch.ones(2)))


if __name__ == "__main__":
    unittest.main()
