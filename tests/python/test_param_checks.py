"""What a ParamSpec and a ShardedParam refuse, naming the key: a shard of another dtype than the one
declared (at construction, set later, or as optimizer state), and a trailing that is not what one TP
rank holds (a row-parallel weight's global width given as trailing); and the shapes and record a
spec makes."""
import unittest

import torch

import shardckpt as sc
from support import spec_at


def plain(tp_axis="rows", tp=1, trailing=(3,), rows=4, **kw):
    return sc.ParamSpec("layers.0.w", sc.plain_sections(rows), list(trailing), tp_axis=tp_axis, tp=tp, **kw)


class DeclaredDtype(unittest.TestCase):
    def assert_refused(self, make, got, declared):
        with self.assertRaises(TypeError) as e:
            make()
        for text in ("layers.0.w", got, declared):
            self.assertIn(text, str(e.exception))

    def test_a_shard_of_another_dtype_than_declared_is_refused_at_construction(self):
        self.assert_refused(lambda: sc.ShardedParam(plain(), 1, 0, 0, 0, shard=torch.zeros(4, 3), dtype=torch.bfloat16),
                            "f32", "bf16")

    def test_a_shard_set_later_must_have_the_declared_dtype(self):
        p = sc.ShardedParam(plain(), 1, 0, 0, 0, dtype=torch.bfloat16)
        def set_f32():
            p.shard = torch.zeros(4, 3)
        self.assert_refused(set_f32, "f32", "bf16")
        self.assertEqual(p.dtype, "bf16")
        self.assertIsNone(p.shard)
        p.shard = torch.zeros(4, 3, dtype=torch.bfloat16)
        self.assertEqual(p.dtype, "bf16")

    def test_optimizer_state_of_a_declared_dtype_refuses_a_shard_of_another(self):
        p = sc.ShardedParam(plain(), 1, 0, 0, 0, dtype=torch.bfloat16)
        self.assert_refused(lambda: p.optimizer_state("exp_avg", shard=torch.zeros(4, 3, dtype=torch.bfloat16),
                                                      dtype=torch.float32), "bf16", "f32")
        m = p.optimizer_state("exp_avg", dtype=torch.float32)
        def set_bf16():
            m.shard = torch.zeros(4, 3, dtype=torch.bfloat16)
        self.assert_refused(set_bf16, "bf16", "f32")

    def test_without_a_declared_dtype_the_shard_gives_it(self):
        p = sc.ShardedParam(plain(), 1, 0, 0, 0, shard=torch.zeros(4, 3, dtype=torch.float16))
        self.assertEqual(p.dtype, "f16")
        p.shard = torch.zeros(4, 3, dtype=torch.float64)
        self.assertEqual(p.dtype, "f64")
        self.assertEqual(p.optimizer_state("exp_avg", shard=torch.zeros(4, 3, dtype=torch.bfloat16)).dtype, "bf16")


class Trailing(unittest.TestCase):
    def test_every_size_is_what_one_tp_rank_holds_and_the_shapes_say_so(self):
        out_proj = plain("cols", tp=2, trailing=[12], rows=16)  # a (16, 24) weight, TP splits dim 1
        self.assertEqual(out_proj.local_shape(), (16, 12))
        self.assertEqual(out_proj.global_shape(), (16, 24))
        norm = plain("replicated", tp=2, trailing=[], rows=20)
        self.assertEqual((norm.local_shape(), norm.global_shape()), ((20,), (20,)))
        fused = spec_at(2)
        self.assertEqual(fused.local_shape(), (fused.rows(), 8))
        self.assertEqual(fused.global_shape(), (2 * fused.rows(), 8))
        self.assertIn("global shape [16, 24]", repr(out_proj))

    def test_a_global_width_given_as_trailing_is_refused_where_it_can_be_seen(self):
        # With global_shape=, at construction.
        with self.assertRaises(ValueError) as e:
            plain("cols", tp=2, trailing=[32], rows=4, global_shape=(4, 32))
        for text in ("layers.0.w", "[4, 64]", "global_shape [4, 32]", "trailing[0] is the global dim 1 / tp"):
            self.assertIn(text, str(e.exception))
        self.assertEqual(plain("cols", tp=2, trailing=[16], rows=4, global_shape=(4, 32)).trailing, [16])
        with self.assertRaises(ValueError):
            plain("rows", tp=2, trailing=[8], rows=4, global_shape=(4, 8))  # 4 rows are TP-local: 8 in all
        # With the shard: this TP rank's columns against a spec of the global width.
        p = sc.ShardedParam(plain("cols", tp=2, trailing=[32], rows=4), 1, 0, 0, 0)
        with self.assertRaises(ValueError) as e:
            p.shard = torch.zeros(4, 16)
        for text in ("layers.0.w", "[4, 16]", "trailing[0] is this TP rank's columns", "[4, 64]"):
            self.assertIn(text, str(e.exception))

    def test_the_record_is_what_the_checkpoint_and_adopt_take(self):
        self.assertEqual(plain("cols", tp=2, trailing=[12], rows=16).record(),
                         {"key": "layers.0.w", "tp_axis": "cols", "blocks": [{"name": "", "rows": 16}],
                          "trailing": [24]})
        record = spec_at(2).record()
        self.assertEqual(record["blocks"][:2], [{"name": "z", "rows": 32}, {"name": "V0", "rows": 32}])
        self.assertEqual(record["divisors"], [{"name": "heads", "count": 8}, {"name": "groups", "count": 4}])
        self.assertEqual(record, spec_at(1).record())  # global: the same at any TP


if __name__ == "__main__":
    unittest.main()
