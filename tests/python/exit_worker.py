"""One process of a 3-process gloo job that ends the way training scripts end (tests/python/test_exit.py):
without destroy_process_group, and in `async` with a save still in flight. `save DIR` saves a
checkpoint; `load DIR` loads it into its shards, checks them and exits; `async DIR` saves, loads and
checks, then starts a save through a Saver that nobody waits for, and exits (the interpreter's exit
must let that save end: its checkpoint is then complete)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import shardckpt as sc  # noqa: E402
from support import reference, shard_of, spec_at  # noqa: E402

GTP, ALIGN = 3, 8


def state(rank, fill):
    p = sc.ShardedParam(spec_at(1), gtp=GTP, align=ALIGN, tp_rank=0, gtp_rank=rank, dtype=torch.bfloat16)
    p.shard = shard_of(reference(1, 0), p) if fill else torch.full(p.padded_shape(), 7, dtype=torch.bfloat16)
    s = sc.StateDict()
    s.add(p)
    if fill:
        s.add_common("step", 5)
    return s, p


def load_and_check(path, group, rank):
    s, p = state(rank, fill=False)
    assert sc.load_into(path, s, group) == {"step": 5}
    assert torch.equal(p.shard, shard_of(reference(1, 0), p)), "loaded rows differ"


def main():
    what, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = sc.TorchGroup()
    path = os.path.join(out, "ckpt.h5")
    if what == "save":
        sc.save(state(rank, fill=True)[0], path, group)
    elif what == "load":
        load_and_check(path, group, rank)
    elif what == "async":
        global saver, pending  # alive until the interpreter's exit, as a script's globals are
        saver = sc.Saver(group, staging_buffer_bytes=1024)  # a budget of 2 KiB: this rank's rows stream
        s, _ = state(rank, fill=True)
        saver.save(s, os.path.join(out, "sync.h5"))
        load_and_check(os.path.join(out, "sync.h5"), group, rank)
        pending = saver.save_async(s, os.path.join(out, "async.h5"))  # in flight at exit, never waited for
    print(what, "done on rank", rank, flush=True)


if __name__ == "__main__":
    main()
