"""Megatron-core's dist_checkpointing with shardckpt: a module whose fused GatedDeltaProduct in_proj is
GTP-sharded describes it in its sharded_state_dict() with shardckpt.megatron.gtp_sharded_state_dict,
saves through Megatron with the "shardckpt" backend (no gather; pad rows never written), and loads
at another GTP size and alignment (megatron-core 0.16 or 0.19: the strategy objects work on both). Run on N processes (N even) as torchrun starts them:
    torchrun --nproc-per-node 4 megatron_gtp.py DIR
Prints "megatron: saved DIR/step1 at TP 2 x GTP 2, loaded at TP 1 x GTP 4, pad rows zero" on rank 0."""
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

import shardckpt as sc
from shardckpt.megatron import LoadStrategy, SaveStrategy, gtp_sharded_state_dict

DIMS = sc.SsmDims(heads=8, head_dim=4, groups=4, state=4, householder=2)
HIDDEN = 8


class Mixer(torch.nn.Module):
    """A GatedDeltaProduct mixer whose in_proj rank holds a padded row shard (TP x GTP)."""

    def __init__(self, tp, gtp, align):
        super().__init__()
        rank = dist.get_rank()
        spec = sc.ParamSpec("in_proj.weight", sc.gdp_in_proj_sections(DIMS, tp), [HIDDEN], tp=tp,
                            divisors=sc.ssm_divisors(DIMS))
        self.in_proj_param = sc.ShardedParam(spec, gtp=gtp, align=align, tp_rank=rank // gtp, gtp_rank=rank % gtp)
        self.in_proj = torch.nn.Parameter(torch.zeros(self.in_proj_param.padded_shape()))  # pad rows stay zero
        self.in_proj_param.shard = self.in_proj.data
        self.norm = torch.nn.Parameter(torch.ones(HIDDEN))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = gtp_sharded_state_dict(self.in_proj_param, prefix=prefix)  # one ShardedTensor per block
        sd[prefix + "norm.weight"] = ShardedTensor.from_rank_offsets(
            prefix + "norm.weight", self.norm.data, replica_id=dist.get_rank())  # replicated
        return sd


def tp_weight(spec, tp_rank):
    """TP rank `tp_rank`'s weight (before GTP), the same on every rank that asks."""
    return torch.randn(spec.local_shape(), generator=torch.Generator().manual_seed(tp_rank))


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mixer = Mixer(tp=2, gtp=world // 2, align=16)
    tp_rank = mixer.in_proj_param.tp_rank
    weight = tp_weight(mixer.in_proj_param.spec, tp_rank)  # this TP rank's weight before GTP
    mixer.in_proj.data.copy_(mixer.in_proj_param.shard_of(weight))
    ckpt = os.path.join(out, "step1")
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)  # Megatron saves into an existing directory
    dist.barrier()
    dist_checkpointing.save(mixer.sharded_state_dict("decoder.layers.0.mixer."), ckpt,
                            sharded_strategy=SaveStrategy(), validate_access_integrity=False)

    # Another GTP size and alignment.
    other = Mixer(tp=1, gtp=world, align=8)
    dist_checkpointing.load(other.sharded_state_dict("decoder.layers.0.mixer."), ckpt,
                            sharded_strategy=LoadStrategy(), validate_access_integrity=False)
    # The weight without TP, to check against: each block's rows of TP rank 0, then of TP rank 1.
    spec2 = mixer.in_proj_param.spec
    parts, start = [], 0
    for section in spec2.sections:
        parts += [tp_weight(spec2, t)[start:start + section.rows] for t in range(2)]
        start += section.rows
    full = torch.cat(parts)
    expected = other.in_proj_param.shard_of(full)
    assert torch.equal(other.in_proj.data, expected), "the loaded shard differs"
    assert not other.in_proj.data[other.in_proj_param.real_rows():].any(), "pad rows are not zero"
    if dist.get_rank() == 0:
        print(f"megatron: saved {ckpt} at TP 2 x GTP {world // 2}, loaded at TP 1 x GTP {world}, pad rows zero")
    dist.barrier()  # every rank done with the group before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
