"""Reads over the checkpoint file: read() and load() give a tensor whose rows lie in the file as they
lie in memory as a private mapping of the file (every row checked), which lives as long as the last
tensor over it; map=False gives memory of its own."""
import gc
import os
import shutil
import tempfile
import unittest

import torch

import shardckpt as sc


def mapped_from(tensor, path):
    """Whether the tensor's bytes lie inside a mapping of `path` in this process."""
    name = os.path.realpath(path)
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(name):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= begin and end <= hi:
                    return True
    return False


def mappings_of(path):
    """The lines of /proc/self/maps that map `path` (also once it is replaced: "(deleted)")."""
    name = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        return [line for line in maps if name in line]


def save(path, weight, moment):
    state = sc.StateDict()
    state.add(sc.ShardedTensor("w", weight, list(weight.shape), [0, 0]))
    state.add(sc.ShardedTensor("m", moment, list(moment.shape), [0, 0, 0]))
    state.add_common("step", 7)
    sc.save(state, path)


class Mapped(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-map-")
        self.path = os.path.join(self.dir, "a.h5")
        self.w = torch.arange(512 * 64, dtype=torch.float32).reshape(512, 64)  # 128 KiB: its data aligned
        self.m = torch.rand(4, 128, 64)
        save(self.path, self.w, self.m)

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_read_maps_what_lies_in_the_file_as_in_memory_and_map_false_copies(self):
        got = sc.read(self.path)
        self.assertEqual(got["step"], 7)
        self.assertTrue(torch.equal(got["w"], self.w))
        self.assertTrue(torch.equal(got["m"], self.m))
        self.assertTrue(mapped_from(got["w"], self.path))
        self.assertTrue(mapped_from(got["m"], self.path))
        copied = sc.read(self.path, map=False)
        self.assertTrue(torch.equal(copied["w"], self.w))
        self.assertFalse(mapped_from(copied["w"], self.path))
        request = sc.StateDict()
        request.add(sc.ShardedTensor.expect("w", torch.float32, [128, 64], [512, 64], [128, 0]))
        part = sc.load(self.path, request)["w"]
        self.assertTrue(mapped_from(part, self.path))
        self.assertTrue(torch.equal(part, self.w[128:256]))
        self.assertFalse(mapped_from(sc.load(self.path, request, map=False)["w"], self.path))

    def test_a_mapped_tensor_is_private_and_lives_past_the_file_it_came_from(self):
        got = sc.read(self.path)
        w = got["w"]
        with open(self.path, "rb") as f:
            before = f.read()
        w.fill_(-1)  # a private mapping: the page is copied
        with open(self.path, "rb") as f:
            self.assertEqual(f.read(), before)
        self.assertTrue(torch.equal(sc.read(self.path)["w"], self.w))
        m = got["m"]
        del got
        gc.collect()
        save(self.path, self.w + 1, self.m + 1)  # replaces the file (a rename)
        self.assertTrue(torch.equal(m, self.m))
        self.assertTrue(any("(deleted)" in line for line in mappings_of(self.path)))  # the old file, kept
        self.assertTrue(torch.equal(sc.read(self.path, map=False)["w"], self.w + 1))
        del w, m
        gc.collect()
        self.assertEqual(mappings_of(self.path), [])  # the last tensor over it is gone

    def test_a_changed_byte_is_an_error_never_a_tensor_with_wrong_bytes(self):
        with open(self.path, "rb") as f:
            data = bytearray(f.read())
        needle = self.w[300, 5].numpy().tobytes()
        at = data.find(needle)
        self.assertGreater(at, 0)
        data[at] ^= 1
        with open(self.path, "wb") as f:
            f.write(data)
        with self.assertRaises(sc.Error) as e:
            sc.read(self.path)
        self.assertEqual(e.exception.code, "corrupt")
        self.assertIn("key w, rows [300, 301)", str(e.exception))

    def test_a_dataset_hard_linked_under_two_names_reads_back_as_two_tensors(self):
        # h5py's idiom for tied weights: f["tied"] = f["w"] is a second name of one dataset, whose
        # bytes lie once in the file. Mapped, both would be one memory: each gets its own.
        import h5py
        with h5py.File(self.path, "r+") as f:
            f["tied"] = f["w"]
            slabs = f["_shardckpt/slabs"]
            slabs.attrs["tied"] = slabs.attrs["w"]
        got = sc.read(self.path)
        a, tied = got["w"], got["tied"]
        self.assertTrue(torch.equal(a, self.w) and torch.equal(tied, self.w))
        self.assertTrue(mapped_from(a, self.path) or mapped_from(tied, self.path))  # one of them is mapped
        a[0, 0] = -5
        tied[1, 1] = -7
        self.assertEqual(tied[0, 0].item(), self.w[0, 0].item())
        self.assertEqual(a[1, 1].item(), self.w[1, 1].item())
        self.assertEqual(a.data_ptr() == tied.data_ptr(), False)


if __name__ == "__main__":
    unittest.main()
