"""One rank of a gloo job of 4 (tests/python/test_messages.py): saves a row-parallel weight at TP 2 x
GTP 2, then loads it with trailing given as the global width, which every rank refuses for its own
shard; prints the message each rank gets. Usage: messages_worker.py PATH"""
import datetime
import sys

import torch
import torch.distributed as dist

import shardckpt as sc

KEY = "decoder.layers.0.self_attention.linear_proj.weight"


def main():
    path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=4))
    rank = dist.get_rank()
    group = sc.TorchGroup()
    tp_rank, gtp_rank = rank // 2, rank % 2
    for trailing, fill in ([16], 1.0), ([32], 0.0):  # a (16, 32) weight; then a spec of 64 columns
        spec = sc.ParamSpec(KEY, sc.plain_sections(16), trailing, tp_axis="cols", tp=2)
        p = sc.ShardedParam(spec, 2, 8, tp_rank, gtp_rank, shard=torch.full((8, trailing[0]), fill))
        state = sc.StateDict()
        state.add(p)
        if fill:
            sc.save(state, path, group)
            continue
        try:
            sc.load_into(path, state, group)
        except sc.Error as e:
            print(f"ERROR {e.code}: {e}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
