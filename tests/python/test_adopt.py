"""shardckpt.adopt: a safetensors file of the weights without TP (written here by hand, as the format
says) becomes a checkpoint through the library's adopt, with ParamSpec records and common values;
it loads at another layout and reads back with its values (shardckpt.read gives both)."""
import json
import os
import shutil
import struct
import tempfile
import unittest

import torch

import shardckpt as sc
from support import reference, spec_at

DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def write_safetensors(path, tensors):
    """A safetensors file: an 8-byte little-endian header length, the JSON header, the row-major bytes."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, t in tensors.items():
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).contiguous().numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


class Adopt(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-adopt-")
        self.source = os.path.join(self.dir, "model.safetensors")
        self.out = os.path.join(self.dir, "model.shardckpt.h5")
        self.out_proj = torch.arange(16 * 24, dtype=torch.float32).reshape(16, 24)
        self.norm = torch.ones(20)
        self.in_proj = reference(1, 0, "mamba")  # the fused in_proj without TP: z, x, B, C, dt
        write_safetensors(self.source, {spec_at(1, "mamba").key: self.in_proj, "out_proj.weight": self.out_proj,
                                        "norm.weight": self.norm})
        tp = 2  # the specs of a TP 2 run: their records are global
        self.specs = [spec_at(tp, "mamba"),
                      sc.ParamSpec("out_proj.weight", sc.plain_sections(16), [12], tp_axis="cols", tp=tp),
                      sc.ParamSpec("norm.weight", sc.plain_sections(20), [], tp_axis="replicated", tp=tp)]

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_a_safetensors_file_adopted_with_specs_loads_and_reads_back_with_its_values(self):
        report = sc.adopt(self.source, self.out, self.specs, {"step": 1200, "lr": 3e-4, "run": "exp-7"})
        self.assertEqual(report["fused"], 1)
        self.assertEqual(report["params"], 3)
        self.assertEqual(report["tensors"], 5 + 2)
        self.assertEqual(sc.verify(self.out)["mismatches"], 0)
        back = sc.read(self.out)
        self.assertEqual({k: back[k] for k in ("step", "lr", "run")}, {"step": 1200, "lr": 3e-4, "run": "exp-7"})
        self.assertTrue(torch.equal(back[spec_at(1, "mamba").key], self.in_proj))
        self.assertTrue(torch.equal(back["out_proj.weight"], self.out_proj))
        self.assertTrue(torch.equal(back["norm.weight"], self.norm))
        # At TP 2 x GTP 3: each rank's shard is the one shard_of cuts from the weight without TP.
        for spec, weight in zip(self.specs, [self.in_proj, self.out_proj, self.norm]):
            for t in range(2):
                for g in range(3):
                    p = sc.ShardedParam(spec, gtp=3, align=8, tp_rank=t, gtp_rank=g, dtype=weight.dtype)
                    p.shard = torch.empty(p.padded_shape(), dtype=weight.dtype)
                    request = sc.StateDict()
                    request.add(p)
                    self.assertEqual(sc.load_into(self.out, request)["step"], 1200)
                    self.assertTrue(torch.equal(p.shard, p.shard_of(weight)), (spec.key, t, g))

    def test_records_that_do_not_describe_the_file_are_refused_and_nothing_is_written(self):
        wrong = sc.ParamSpec("out_proj.weight", sc.plain_sections(16), [24], tp_axis="cols", tp=2)  # 48 columns
        with self.assertRaises(sc.Error) as e:
            sc.adopt(self.source, self.out, [wrong])
        self.assertEqual(e.exception.code, "invalid_argument")
        self.assertIn("out_proj.weight", str(e.exception))
        self.assertFalse(os.path.exists(self.out))
        with self.assertRaises(TypeError):
            sc.adopt(self.source, self.out, self.specs, {"step": [1]})

    def test_record_dicts_are_taken_as_the_cli_takes_them(self):
        records = [s.record() for s in self.specs]
        sc.adopt(self.source, self.out, records, {})
        self.assertEqual(len(sc.inspect(self.out)["params"]), 3)


if __name__ == "__main__":
    unittest.main()
