"""shardckpt over torch.distributed: gloo jobs of several processes save and load GTP shards with
TorchGroup, each rank writing only its own rows; another job loads them at another layout."""
import os
import shutil
import tempfile
import unittest

import h5py
import torch

import shardckpt as sc
from support import h5py_bf16, reference, run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


class TorchGroupJobs(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-torch-")
        self.path = os.path.join(self.dir, "ckpt.h5")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def job(self, world, *args):
        results = run_ranks(world, WORKER, *args)
        for rank, (rc, out) in enumerate(results):
            self.assertEqual(rc, 0, f"rank {rank} of {' '.join(map(str, args))}:\n{out}")
        return [out for _, out in results]

    def test_saved_at_tp2_gtp2_loads_at_tp1_gtp3_and_tp2_gtp1(self):
        self.job(4, "save", 2, 2, 16, self.path)
        sc.verify(self.path)
        # The file holds the plain TP=1 blocks: h5py reads each block as a plain run wrote it.
        with h5py.File(self.path, "r") as f:
            key = "decoder.layers.0.mixer.gdp.in_proj.weight.z"
            z = h5py_bf16(f[key])
            self.assertTrue(torch.equal(z, reference(1, 0)[:z.shape[0]]))
        self.job(3, "load", 1, 3, 8, self.path)
        self.job(2, "load", 2, 1, 0, self.path)

    def test_async_save_through_a_saver_keeps_what_was_staged(self):
        outs = self.job(4, "async", 2, 2, 16, self.path)
        self.assertTrue(all("async done True 4" in o for o in outs), outs)
        self.job(3, "load", 1, 3, 8, self.path)

    def test_an_error_on_one_rank_is_raised_on_every_rank(self):
        outs = self.job(4, "badshape", 2, 2, 16, self.path)
        errors = {o.strip().splitlines()[-1] for o in outs}
        self.assertEqual(len(errors), 1, outs)
        self.assertTrue(errors.pop().startswith("ERROR dtype_mismatch"), outs)
        self.assertFalse(os.path.exists(self.path))

    def test_memory_freed_on_one_rank_fails_the_save_on_every_rank(self):
        outs = self.job(4, "gone", 2, 2, 16, self.path)  # and none waits for the others: job() has a timeout
        last = [o.strip().splitlines()[-1] for o in outs]
        key = "decoder.layers.0.mixer.gdp.in_proj.weight"
        self.assertTrue(last[1].startswith(f"ERROR shard_changed: the memory of a tensor of this state dict changed "
                                           f"since it was added"), last[1])
        self.assertIn(f"{key}: RuntimeError: setStorage", last[1])
        for rank in (0, 2, 3):
            self.assertTrue(last[rank].startswith("ERROR invalid_argument:"), last[rank])
            self.assertIn(f"parameter {key} (TP rank 0, GTP rank 1): no shard to save", last[rank])
        self.assertFalse(os.path.exists(self.path))

    def test_metadata_collectives_carry_every_length_in_member_order(self):
        outs = self.job(4, "collectives", 1, 4, 0, self.path)
        self.assertTrue(all("collectives ok" in o for o in outs), outs)

    def test_read_joins_fused_blocks_at_any_tp(self):
        self.job(4, "save", 2, 2, 16, self.path)
        for tp in (1, 2):
            for tp_rank in range(tp):
                weights = sc.read(self.path, tp=tp, tp_rank=tp_rank)
                for kind in ("gdp", "mamba"):
                    got = weights[f"decoder.layers.0.mixer.{kind}.in_proj.weight"]
                    self.assertEqual(got.dtype, torch.bfloat16)
                    self.assertTrue(torch.equal(got, reference(tp, tp_rank, kind)), (kind, tp, tp_rank))


if __name__ == "__main__":
    unittest.main()
