#!/usr/bin/python3
"""The h5py comparison of shardckpt-bench (docs/performance.md).

Writes the same pieces into the same dataset shapes as a shardckpt save, the way most users would
with h5py: create every dataset at its global shape, then one hyperslab write per piece
(``dset[o0:o0+c0, o1:o1+c1, ...] = array``), close the file and fsync it. The numpy arrays of every
piece are created before the clock starts; creating the file and its datasets is timed, as a save's
skeleton is.

numpy has no bfloat16, so 2-byte elements are written as HDF5 little-endian uint16: the same bytes,
no conversion. Other dtypes map to their numpy types.

usage: h5py_compare.py PIECES.json OUT.h5   (the plan shardckpt-bench dumps); prints one JSON object.
"""
import json
import os
import sys
import time

import h5py
import numpy as np

NUMPY = {"bf16": "<u2", "f16": "<f2", "f32": "<f4", "f64": "<f8", "i8": "i1", "i16": "<i2", "i32": "<i4",
         "i64": "<i8", "u8": "u1", "u16": "<u2", "u32": "<u4", "u64": "<u8"}


def main():
    plan_path, out_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    datasets = plan["datasets"]
    # The data, built before timing: one contiguous array per piece, as a rank's shard rows are.
    pieces = []
    for i, p in enumerate(plan["pieces"]):
        arr = np.empty(p["count"], dtype=NUMPY[p["dtype"]])
        arr.fill(i & 0x7F)  # touches every page now, so that no page fault lands in the timed writes
        index = tuple(slice(o, o + c) for o, c in zip(p["offset"], p["count"]))
        pieces.append((p["key"], index, arr))
    nbytes = sum(arr.nbytes for _, _, arr in pieces)

    if os.path.exists(out_path):
        os.remove(out_path)
    t0 = time.perf_counter()
    with h5py.File(out_path, "w") as f:
        sets = {d["key"]: f.create_dataset(d["key"], shape=tuple(d["shape"]), dtype=NUMPY[d["dtype"]]) for d in datasets}
        for key, index, arr in pieces:
            sets[key][index] = arr
    fd = os.open(out_path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - t0

    print(json.dumps({"seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9, "pieces": len(pieces),
                      "datasets": len(datasets), "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version}))


if __name__ == "__main__":
    main()
