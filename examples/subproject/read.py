#!/usr/bin/python3
"""Reads the tutorial's two checkpoints as plain HDF5 (docs/tutorial.md): same keys, same shapes, same
values, whatever layout saved them."""
import h5py
import numpy as np

with h5py.File("tutorial.h5", "r") as a, h5py.File("resharded.h5", "r") as b:
    tensors = [k for k in a if isinstance(a[k], h5py.Dataset)]
    for key in tensors:
        assert np.array_equal(a[key][()], b[key][()]), key
        print(f"{key:32} {str(a[key].shape):12} {a[key].dtype}")
    print("step:", a["_shardckpt/common"].attrs["step"])
    # Row i of each block holds its global row number i.
    print("V0 rows 0..3, first column:", a["layers.0.in_proj.weight.V0"][:4, 0])
    print(f"{len(tensors)} tensors, equal in both files")
