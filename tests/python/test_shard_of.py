"""ShardedParam.shard_of: a rank's padded shard cut from the weight without TP or from its TP rank's
weight is what the library saves and loads for that rank, for fused, row-parallel, replicated and
plain weights, at every layout; torch in, torch out; numpy in, numpy out."""
import os
import shutil
import tempfile
import unittest

import numpy as np
import torch

import shardckpt as sc
from support import reference, run_ranks, spec_at

HERE = os.path.dirname(os.path.abspath(__file__))


def models(tp):
    """(spec at TP `tp`, its weight without TP) of a row-parallel out_proj (TP splits dim 1), a
    replicated norm, and a plain column-parallel weight of two trailing dims."""
    out_proj = torch.arange(16 * 24, dtype=torch.float32).reshape(16, 24)
    norm = torch.arange(20, dtype=torch.float32) + 0.5
    conv = torch.arange(12 * 3 * 2, dtype=torch.int32).reshape(12, 3, 2)
    return [
        (sc.ParamSpec("layers.0.mixer.out_proj.weight", sc.plain_sections(16), [24 // tp], tp_axis="cols", tp=tp,
                      global_shape=(16, 24)), out_proj),
        (sc.ParamSpec("layers.0.norm.weight", sc.plain_sections(20), [], tp_axis="replicated", tp=tp), norm),
        (sc.ParamSpec("layers.0.conv.weight", sc.plain_sections(12 // tp), [3, 2], tp=tp), conv),
    ]


def everything(tp):
    """Every (spec at `tp`, weight without TP, TP rank -> that rank's weight) of the tests."""
    fused = [(spec_at(tp, kind), reference(1, 0, kind), lambda t, kind=kind: reference(tp, t, kind))
             for kind in ("gdp", "mamba")]
    locals_ = {  # each TP rank's weight, cut here by the layout rule the docs state
        "cols": lambda w, t: w[:, t * w.shape[1] // tp:(t + 1) * w.shape[1] // tp],
        "replicated": lambda w, t: w,
        "rows": lambda w, t: w[t * w.shape[0] // tp:(t + 1) * w.shape[0] // tp],
    }
    return fused + [(s, w, lambda t, s=s, w=w: locals_[s.tp_axis](w, t)) for s, w in models(tp)]


class ShardOf(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-shard-of-")
        self.path = os.path.join(self.dir, "a.h5")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_shards_cut_from_the_weights_without_tp_save_and_read_back_exactly(self):
        results = run_ranks(4, os.path.join(HERE, "shard_of_worker.py"), self.path)
        for rank, (rc, text) in enumerate(results):
            self.assertEqual(rc, 0, f"rank {rank}:\n{text}")
        self.assertIn("read back", results[0][1])

    def test_a_shard_cut_by_shard_of_is_what_a_load_fills_at_every_layout(self):
        state = sc.StateDict()
        for spec, weight, _ in everything(1):
            state.add(sc.ShardedParam(spec, 1, 0, 0, 0, shard=weight))
        sc.save(state, self.path)
        for tp, gtp, align in [(1, 1, 0), (1, 3, 8), (2, 2, 16), (2, 3, 1), (4, 2, 16), (4, 5, 4)]:
            for spec, weight, local_of in everything(tp):
                for t in range(tp):
                    for g in range(gtp):
                        p = sc.ShardedParam(spec, gtp=gtp, align=align, tp_rank=t, gtp_rank=g)
                        loaded = torch.full(p.padded_shape(), 7, dtype=weight.dtype)  # the load zeroes pad rows
                        p.shard = loaded
                        request = sc.StateDict()
                        request.add(p)
                        sc.load_into(self.path, request)
                        where = (spec.key, tp, gtp, align, t, g)
                        cut = p.shard_of(weight)
                        self.assertIsInstance(cut, torch.Tensor)
                        self.assertEqual(cut.dtype, weight.dtype, where)
                        self.assertTrue(torch.equal(cut, loaded), where)
                        self.assertTrue(torch.equal(p.shard_of(local_of(t)), loaded), where)

    def test_numpy_in_numpy_out_and_a_flat_range(self):
        spec, weight = models(2)[0]
        p = sc.ShardedParam(spec, gtp=3, align=2, tp_rank=1, gtp_rank=2)
        want = p.shard_of(weight)
        cut = p.shard_of(weight.numpy())
        self.assertIsInstance(cut, np.ndarray)
        self.assertEqual(cut.dtype, np.float32)
        self.assertTrue(np.array_equal(cut, want.numpy()))
        flat = sc.ShardedParam(spec, gtp=3, align=2, tp_rank=1, gtp_rank=2, flat=(5, 40))
        self.assertEqual(flat.flat, (5, 40))
        self.assertTrue(torch.equal(flat.shard_of(weight), want.reshape(-1)[5:40]))
        flat.shard = flat.shard_of(weight)  # the shape a flat range's shard has

    def test_a_weight_of_neither_shape_is_refused_naming_both(self):
        spec, weight = models(2)[0]
        p = sc.ShardedParam(spec, gtp=2, align=0, tp_rank=0, gtp_rank=0)
        with self.assertRaises(ValueError) as e:
            p.shard_of(weight[:, :7])
        for text in (spec.key, "[16, 7]", "[16, 24]", "[16, 12]"):
            self.assertIn(text, str(e.exception))
        with self.assertRaises(TypeError):
            p.shard_of(weight.tolist())


if __name__ == "__main__":
    unittest.main()
