// shardckpt: the whole library in one import. Save and load GTP-sharded, fused tensor-parallel
// weights as HDF5 checkpoints without ever gathering a full tensor (docs/user-guide.md). It only
// re-exports: the optional modules (shardckpt.dist.mpi, shardckpt.cuda, shardckpt.dist.nccl) are
// imported by name where the build has them.
export module shardckpt;
export import shardckpt.core;
export import shardckpt.layout;
export import shardckpt.views;
export import shardckpt.engine;
export import shardckpt.storage;
export import shardckpt.state;
export import shardckpt.merge;
export import shardckpt.dist;
