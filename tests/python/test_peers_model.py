"""bench/peers.py's model (bench/peers/model.py), which DCP and safetensors are measured on: the
bench's size, every block tiled exactly once by the pieces a save writes, and the values a rank puts
in its shards where shardckpt puts them (read back at TP 1)."""
import os
import shutil
import sys
import tempfile
import unittest
from math import prod

import torch

import shardckpt as sc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from peers import model  # noqa: E402


class PeersModel(unittest.TestCase):
    def test_the_default_size_is_shardckpt_bench_s_model(self):
        c = model.bench_config(1024 << 20)
        self.assertEqual((c.gdp_layers, c.mamba_layers, c.cols), (11, 3, 2048))
        self.assertEqual(model.model_bytes(c), 1058684928)  # docs/performance.md, Method

    def test_the_pieces_a_save_writes_tile_every_block_once(self):
        c = model.bench_config(48 << 20)
        for layout in (model.Layout(2, 4, 32), model.Layout(1, 8, 16), model.Layout(2, 3, 8)):
            for key, held in model.all_pieces(c, layout).items():
                written = [p for _, p in held if p.replica == 0]
                shape = written[0].global_shape
                self.assertEqual(sum(prod(p.size) for p in written), prod(shape), (key, layout))
                cover = torch.zeros(shape[:2] if len(shape) > 1 else shape, dtype=torch.int32)
                for p in written:
                    index = tuple(slice(o, o + s) for o, s in zip(p.offset, p.size))[:cover.dim()]
                    cover[index] += 1
                self.assertTrue(bool((cover == 1).all()), (key, layout))

    def test_a_rank_s_values_are_where_shardckpt_puts_them(self):
        c = model.Config(gdp_layers=1, mamba_layers=1, cols=256)
        whole = model.rank_model(c, model.Layout(1, 1, 1), 0)
        state = sc.StateDict()
        for rp in whole.params:
            state.add(sc.ShardedParam(rp.spec, gtp=1, align=1, tp_rank=0, gtp_rank=0, shard=rp.shard))
        d = tempfile.mkdtemp(prefix="sc-peers-")
        try:
            sc.save(state, os.path.join(d, "m.h5"))
            got = sc.read(os.path.join(d, "m.h5"))
        finally:
            shutil.rmtree(d, ignore_errors=True)
        for rp in whole.params:  # every block's pattern, joined in section order
            want = torch.cat([model.pattern(p) for p in rp.pieces])
            self.assertTrue(torch.equal(got[rp.spec.key].view(torch.int16), want.view(torch.int16)), rp.spec.key)


if __name__ == "__main__":
    unittest.main()
