#!/usr/bin/python3
"""Reads a shardckpt checkpoint with h5py alone (docs/format-walkthrough.md, "Reading with h5py").
Usage: read_checkpoint.py CHECKPOINT (a demo checkpoint: `shardckpt demo --out doc.h5`)."""
import json
import sys

import h5py

with h5py.File(sys.argv[1], "r") as f:
    meta = f["_shardckpt"].attrs
    assert meta["complete"] == 1 and meta["format"] == b"shardckpt"   # fixed-length strings are bytes
    print(meta["format_version"], meta["kind"].decode(), meta["checkpoint_id"].decode())
    params = json.loads(meta["params"])
    in_proj = next(p for p in params if p["key"] == "decoder.layers.0.mixer.in_proj.weight")
    print([(b["name"], b["rows"]) for b in in_proj["blocks"]][:3])
    v1 = f["decoder.layers.0.mixer.in_proj.weight.V1"]
    print(v1.shape, v1.dtype)                                         # bf16 on disk
    print(v1[64:66, :3])                                              # rows of TP rank 1
    print(f["_shardckpt/slabs"].attrs["decoder.layers.0.mixer.in_proj.weight.V1"])
    print(f["_shardckpt/checksums"].shape, f["_shardckpt/common"].attrs["iteration"])
