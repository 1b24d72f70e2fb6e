"""One rank of a gloo job at TP 2 x GTP 2 (alignment 16) whose shards are all cut by
ShardedParam.shard_of from the weights without TP (tests/python/test_shard_of.py): a fused GDP
in_proj, a row-parallel out_proj and a replicated norm. They save one checkpoint together; rank 0
then reads it at TP 1 and prints "read back" when every weight is the one it was cut from.
Usage: shard_of_worker.py PATH"""
import datetime
import sys

import torch
import torch.distributed as dist

import shardckpt as sc
from support import reference, spec_at
from test_shard_of import models

TP, GTP, ALIGN = 2, 2, 16


def main():
    path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=4))
    rank = dist.get_rank()
    state = sc.StateDict()
    for spec, weight in [(spec_at(TP), reference(1, 0))] + [(s, w) for s, w in models(TP)]:
        p = sc.ShardedParam(spec, gtp=GTP, align=ALIGN, tp_rank=rank // GTP, gtp_rank=rank % GTP)
        p.shard = p.shard_of(weight)
        state.add(p)
    sc.save(state, path, sc.TorchGroup())
    dist.barrier()
    if rank == 0:
        back = sc.read(path)
        for spec, weight in [(spec_at(TP), reference(1, 0))] + [(s, w) for s, w in models(TP)]:
            assert torch.equal(back[spec.key], weight), spec.key
        print("read back", sorted(back))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
