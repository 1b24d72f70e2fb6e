#!/usr/bin/python3
"""Recomputes every row checksum of a checkpoint a save wrote, with h5py and xxhash alone
(docs/format-walkthrough.md, "Recomputing the checksums"). Contiguous and band-chunked datasets.
Usage: recompute_checksums.py CHECKPOINT. Exits 1 at the first row that does not match."""
import sys

import h5py
import numpy as np
import xxhash

path = sys.argv[1]
with open(path, "rb") as file, h5py.File(path, "r") as f:
    assert f["_shardckpt"].attrs["checksums"] == b"xxh3-64 of each row of each slab"
    sums = f["_shardckpt/checksums"][()]           # uint64, one per checksummed row
    checked = 0
    for key, table in f["_shardckpt/slabs"].attrs.items():
        d = f[key]
        es = d.id.get_type().get_size()             # stored bytes per element (2 for bf16)
        width = int(np.prod(d.shape[1:]))           # elements per row, trailing dims flattened
        for r0, r1, c0, c1, first in table:
            for r in range(r0, r1):
                if d.chunks is None:                # contiguous: row after row
                    at = d.id.get_offset() + (r * width + c0) * es
                else:                               # band-chunked: a checksummed row lies in one chunk
                    start = (r,) + np.unravel_index(c0, d.shape[1:])      # its first element
                    corner = tuple(i // n * n for i, n in zip(start, d.chunks))
                    inside = np.ravel_multi_index([i - o for i, o in zip(start, corner)], d.chunks)
                    at = d.id.get_chunk_info_by_coord(corner).byte_offset + int(inside) * es
                file.seek(at)
                row = file.read((c1 - c0) * es)
                if xxhash.xxh3_64_intdigest(row) != int(sums[first + r - r0]):
                    sys.exit(f"{key}: row {r} does not match its checksum")
                checked += 1
print(checked, "of", len(sums), "rows match their checksums")
