// shardckpt.storage: everything that touches a file. A checkpoint is one HDF5 file: every tensor key
// is a dataset at the root with its global shape, so h5ls, h5dump and h5py see plain tensors; library
// metadata sits in the group /_shardckpt. Every row of every slab a rank writes carries an XXH3-64
// checksum, so that a load at any layout checks exactly the bytes it reads; the HDF5 metadata is
// sealed. The partitions: :file (descriptors, directories, temporary files, bulk reads), :format
// (what the file holds, as values), :writer, :reader and :tools. HDF5 itself, the raw-address
// transfers, the seal and the record JSON are implementation partitions that no interface imports,
// so that no consumer needs HDF5's headers. This module never allocates a tensor and knows nothing of
// ranks, process groups or state dicts.
export module shardckpt.storage;
export import :file;
export import :format;
export import :writer;
export import :reader;
export import :tools;
