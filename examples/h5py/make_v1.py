#!/usr/bin/python3
"""Makes a plain HDF5 file (datasets at the root, written by another tool) a version 1 shardckpt
checkpoint in place, by adding the attributes the reader requires (docs/format.md, "Version 1
files"). `shardckpt adopt` does better without changing the file. Usage: make_v1.py FILE."""
import sys

import h5py
import numpy as np

with h5py.File(sys.argv[1], "r+") as f:
    meta = f.create_group("_shardckpt")
    meta.create_group("common")
    meta.attrs["format"] = np.bytes_("shardckpt")
    meta.attrs["format_version"] = np.int64(1)
    meta.attrs["kind"] = np.bytes_("global")
    meta.attrs["params"] = np.bytes_("[]")
    meta.attrs["complete"] = np.int64(1)
