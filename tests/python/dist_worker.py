"""One process of a gloo job (tests/python/test_torch_group.py): `save TP GTP ALIGN DIR` saves
its shards of two fused weights (and Adam-like f32 state, and a step) with TorchGroup; `load TP GTP
ALIGN DIR` loads them back at its own layout and checks every row against the reference;
`async ...` saves through a Saver in the background while it keeps computing; `badshape ...` has
rank 1 pass a wrong dtype, so that every rank must raise the same error; `gone ...` has rank 1 free
a weight's memory after adding it, so that every rank must raise; `collectives ...` checks
TorchGroup's metadata collectives with payloads of every length around its inline slot, and the
timeout of the groups it splits."""
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import shardckpt as sc  # noqa: E402
from support import reference, shard_of, spec_at  # noqa: E402


TIMEOUT = datetime.timedelta(minutes=4)  # a failing job ends in minutes, not torch's default 30


def state_at(tp, gtp, align, rank, fill=True):
    tp_rank, gtp_rank = rank // gtp, rank % gtp
    state = sc.StateDict()
    params = []
    for kind in ("gdp", "mamba"):
        p = sc.ShardedParam(spec_at(tp, kind), gtp=gtp, align=align, tp_rank=tp_rank, gtp_rank=gtp_rank,
                            dtype=torch.bfloat16)
        weight = reference(tp, tp_rank, kind)
        p.shard = shard_of(weight, p) if fill else torch.full(p.padded_shape(), 7, dtype=torch.bfloat16)
        m = p.optimizer_state("exp_avg", dtype=torch.float32)
        m.shard = shard_of(weight.float() / 3, p) if fill else torch.full(p.padded_shape(), 7.0)
        state.add(p)
        state.add(m)
        params.append((p, m, weight))
    if fill:
        state.add_common("step", 42)
    return state, params


def check_collectives(group, rank):
    """all_gather_bytes and broadcast_bytes of empty, inline, boundary and long payloads, in the
    group's member order, also in a split group whose members are ranked in reverse."""
    inline = group.INLINE - 8
    assert group.INLINE == 8192, group.INLINE  # 4 members: the largest slot
    for sizes in ([0] * 4, [1, 0, 3, 17], [inline, inline - 1, 0, 2], [inline + 1, 1, 0, 5000], [inline + 800] * 4):
        for g, members in ((group, [0, 1, 2, 3]), (group.split(0, -rank), [3, 2, 1, 0])):
            payload = lambda r: bytes((r * 7 + i) % 251 for i in range(sizes[r]))  # noqa: E731
            got = g.all_gather_bytes(payload(rank))
            assert got == [payload(m) for m in members], (sizes, [len(b) for b in got])
            for root in range(4):
                mine = payload(members[root]) if g.rank() == root else b"junk"
                assert g.broadcast_bytes(mine, root) == payload(members[root]), (sizes, root)


def check_tensors_lent(group, rank):
    """Every tensor TorchGroup gives torch.distributed is still referenced by shardckpt after the call,
    so a gloo thread that drops it late never frees a Python object (tests/python/test_exit.py)."""
    given = []

    def recording(call):
        def wrapped(*args, **kwargs):
            for a in args:
                given.extend(a if isinstance(a, list) else [a] if isinstance(a, torch.Tensor) else [])
            return call(*args, **kwargs)
        return wrapped

    calls = {name: getattr(dist, name) for name in ("broadcast", "gather")}
    try:
        for name, call in calls.items():
            setattr(dist, name, recording(call))
        group.all_gather_bytes(bytes(5000))
        group.broadcast_bytes(bytes(5000) if rank == 0 else b"", 0)
        rows = torch.zeros(8, dtype=torch.uint8)
        group.all_gather_rows(torch.utils.dlpack.to_dlpack(rows), [2, 2, 2, 2])
    finally:
        for name, call in calls.items():
            setattr(dist, name, call)
    assert len(given) >= 4, given
    held = {id(t) for t in sc._torch._lent}
    assert all(id(t) in held for t in given), f"{sum(id(t) not in held for t in given)} of {len(given)} not held"


def main():
    what, tp, gtp, align, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    group = sc.TorchGroup()
    if what == "save":
        state, _ = state_at(tp, gtp, align, rank)
        sc.save(state, path, group)
    elif what == "async":
        state, params = state_at(tp, gtp, align, rank)
        saver = sc.Saver(group)
        handle = saver.save_async(state, path)
        for p, m, _ in params:  # the caller may change its shards as soon as save_async returns
            p.shard.fill_(-1)
            m.shard.fill_(-1)
        x = torch.ones(1)
        dist.all_reduce(x)  # the caller's own collectives go on beside the background save
        handle.wait()
        print("async done", handle.done(), int(x.item()))
    elif what == "badshape":
        state = sc.StateDict()
        tp_rank, gtp_rank = rank // gtp, rank % gtp
        dtype = torch.float32 if rank == 1 else torch.bfloat16
        p = sc.ShardedParam(spec_at(tp), gtp=gtp, align=align, tp_rank=tp_rank, gtp_rank=gtp_rank,
                            shard=torch.zeros(sc.ShardedParam(spec_at(tp), gtp, align, tp_rank, gtp_rank).padded_shape(),
                                              dtype=dtype))
        state.add(p)
        try:
            sc.save(state, path, group)
        except sc.Error as e:
            print(f"ERROR {e.code}: {e}")
            return
        print("saved")
    elif what == "gone":
        state, params = state_at(tp, gtp, align, rank)
        if rank == 1:  # its weight's memory freed after it was added, as FSDP frees a parameter's
            weight = params[0][0].shard
            (weight.untyped_storage() if hasattr(weight, "untyped_storage") else weight._storage()).resize_(0)
        try:
            sc.save(state, path, group)
        except sc.Error as e:
            print(f"ERROR {e.code}: {e}")
            return
        print("saved")
    elif what == "collectives":
        check_collectives(group, rank)
        check_tensors_lent(group, rank)
        # A group split makes (a Saver's private group) times out as the job's does, not in torch's 30 minutes.
        options = getattr(group.split(0, rank)._pg, "options", None)
        assert getattr(options, "_timeout", TIMEOUT) == TIMEOUT, options._timeout
        print("collectives ok")
    elif what == "load":
        state, params = state_at(tp, gtp, align, rank, fill=False)
        values = sc.load_into(path, state, group)
        assert values == {"step": 42}, values
        for p, m, weight in params:
            want = shard_of(weight, p)
            assert torch.equal(p.shard, want), (p, p.shard, want)
            assert torch.equal(m.shard, shard_of(weight.float() / 3, p)), m
            real = p.real_rows()
            assert not p.shard[real:].any(), "pad rows must be zero"
        print("loaded", [tuple(p.shard.shape) for p, _, _ in params])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
