"""PyTorch Distributed Checkpoint, the way Megatron's dist_checkpointing saves through it (its
torch_dist strategy) with the seed's change: each rank's pieces, each a ShardedTensor of its block's
global tensor holding the rank's piece at its global offset, a view of the rank's padded shard
(nothing gathered, nothing copied to build the state dict).

ShardedTensor, not DTensor: a DTensor's local shard is what its placements on a device mesh compute
(Shard(dim) cuts a dim evenly, as torch.chunk does), so it cannot hold "rows 1,952 to 2,047 of this
block" on one rank and 1,952 rows on the next, the uneven pieces that GTP padding and fused sections
make. A ShardedTensor takes any non-overlapping shards at explicit offsets; like Megatron, this builds
it on every rank from its local shards and global metadata computed without communication
(_init_from_local_shards_and_global_metadata). torch 2.x warns that ShardedTensor is deprecated for
DTensor (the bench silences that warning). torch 2.15 also has dcp.CheckpointableTensor, a plain
tensor carrying its global shape and offsets, newer than what Megatron uses.
"""
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import BlockingAsyncStager

PROPERTIES = TensorProperties(dtype=torch.bfloat16, layout=torch.strided, requires_grad=False,
                              memory_format=torch.contiguous_format, pin_memory=False)


def _metadata(offset, size, rank):
    return ShardMetadata(shard_offsets=list(offset), shard_sizes=list(size), placement=f"rank:{rank}/cpu")


def sharded_tensor(piece, view, holders, me, saving):
    """The ShardedTensor of `piece`'s block on rank `me`, whose one local shard is `view`. `holders`:
    every rank's pieces of the block; each distinct chunk is listed once (a replica's chunk under
    this rank where it holds one), and a save lists only the copies it writes (replica 0)."""
    owner = {}
    for rank, p in holders:
        if saving and p.replica:
            continue
        if (p.offset, p.size) not in owner or rank == me:
            owner[(p.offset, p.size)] = rank
    shards = [_metadata(offset, size, rank) for (offset, size), rank in owner.items()]
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=torch.Size(piece.global_shape),
                                     tensor_properties=PROPERTIES)
    local = [Shard(view, _metadata(piece.offset, piece.size, me))]
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)


def state_dict(model, everyone, saving):
    """{block key: ShardedTensor} of a rank's pieces. A save writes each replicated piece once (TP
    rank 0's, Megatron's main replica); a load fills every rank's, replicas included."""
    out = {}
    for rp in model.params:
        for piece in rp.pieces:
            if saving and piece.replica:
                continue
            out[piece.key] = sharded_tensor(piece, rp.view(piece), everyone[piece.key], model.rank, saving)
    return out


def save(sd, path):
    dcp.save(sd, checkpoint_id=path)  # FileSystemWriter: one file per rank, fsynced


def load(sd, path):
    dcp.load(sd, checkpoint_id=path)  # in place: each shard's view is filled


class KeptStager(BlockingAsyncStager):
    """DCP's own staging for a stager kept across saves (BlockingAsyncStager with
    cache_staged_state_dict=True: CPU copies of the state dict made at the first save, refilled at
    each), without the pinned memory that one allocates, which needs CUDA. (torch 2.15's default
    stager, DefaultStager, fails on ShardedTensors: it asks them for data_ptr.)"""

    def __init__(self):
        super().__init__(cache_staged_state_dict=True)

    def stage(self, state_dict):
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=False)
        return _copy_state_dict(state_dict, self.state_dict_cache)

    def staged_bytes(self):
        return sum(s.tensor.nbytes for v in (self.state_dict_cache or {}).values() for s in v.local_shards())


class AsyncSaver:
    """dcp.async_save through one stager kept for every save, as a trainer keeps it: each save copies
    the rank's pieces into the CPU memory of the first (blocking), then writes them from a thread, on
    a process group of its own."""

    def __init__(self, group):
        self.group, self.stager = group, KeptStager()

    def save_async(self, sd, path):
        return dcp.async_save(sd, checkpoint_id=path, process_group=self.group, async_stager=self.stager)

    def staging_bytes(self):
        return self.stager.staged_bytes()

    def close(self):
        self.stager.close()
