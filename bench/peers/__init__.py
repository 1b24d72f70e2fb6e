"""bench/peers.py's parts (docs/performance.md, "Beside PyTorch DCP and safetensors"):
  model.py           the bench's model (GDP and Mamba layers, bf16), each rank's GTP pieces and shards
  system.py          the page cache, peak memory, clocks and medians
  dcp_side.py        PyTorch Distributed Checkpoint: ShardedTensors over the pieces, save, load, async_save
  shardckpt_side.py  shardckpt through its Python package and TorchGroup: the same four
  jobs.py            the gloo job of 8 processes: the rounds of every distributed phase
  single.py          one process: safetensors against shardckpt's save and read, consolidated
  storage.py         DCP's FileSystemWriter/Reader against shardckpt.dcp's Writer/Reader: a gloo job of
                     DTensors (bf16 weights, Adam's f32 state) under the same dcp.save and dcp.load
  megatron.py        Megatron-core's torch_dist against the shardckpt strategies under the same
                     dist_checkpointing.save / load (and, on 0.19, async saves through its queue)
  mamba.py           no_gather against Megatron 0.19's own gather of a GTP-sharded MambaMixer in_proj
  report.py          the figures, their ratios and spread, the table and --json
"""
