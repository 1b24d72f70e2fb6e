"""One process of a gloo job of torch 2.x (tests/torch2/test_torch2.py): runs every case named on
the command line against checkpoints in DIR, and writes, for each, "ok" or the failure's traceback to
DIR/<case>.<rank>.json. Cases see the same reference tensors on every rank (values built from their
indices), so each can check what it loads against the whole tensor without a collective."""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import shardckpt as sc  # noqa: E402
from support import run_cases  # noqa: E402
from shardckpt.dcp import Reader, Writer  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def ref(shape, dtype=torch.float32, base=0):
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + base).to(dtype)


def h5():
    import h5py
    return h5py


def expect_equal(got, want, what):
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)} {got.flatten()[:6].tolist()}, "
                             f"want {want.dtype} {tuple(want.shape)} {want.flatten()[:6].tolist()}")


# The tensors of the DTensor cases: key -> (global shape, dtype, placements on the save mesh, on the load mesh).
def dtensor_cases(mesh1, mesh2):
    return {
        "rows_uneven": ((10, 6), torch.float32, (mesh1, [Shard(0)]), (mesh2, [Shard(1), Shard(0)])),
        "cols": ((4, 8), torch.float32, (mesh1, [Shard(1)]), (mesh1, [Shard(0)])),
        "replicated": ((5,), torch.float32, (mesh1, [Replicate()]), (mesh1, [Shard(0)])),
        "bf16": ((8, 4), torch.bfloat16, (mesh1, [Shard(0)]), (mesh1, [Replicate()])),
        "grid": ((6, 4), torch.float32, (mesh2, [Shard(0), Shard(1)]), (mesh1, [Shard(1)])),
        "half_replicated": ((8, 2), torch.float32, (mesh2, [Replicate(), Shard(0)]), (mesh2, [Shard(0), Replicate()])),
    }


def dtensor_state(cases, which, fill=True):
    out = {}
    for i, (key, (shape, dtype, save, load)) in enumerate(cases.items()):
        mesh, placements = save if which == "save" else load
        full = ref(shape, dtype, base=100 * i) if fill else torch.full(shape, -1, dtype=dtype)
        out[key] = distribute_tensor(full, mesh, placements)
    return out


def check_dtensors(cases, state):
    for i, (key, (shape, dtype, _, _)) in enumerate(cases.items()):
        expect_equal(state[key].full_tensor(), ref(shape, dtype, base=100 * i), key)


def check_h5(path, cases, prefix=""):
    if RANK != 0:
        return
    with h5().File(path, "r") as f:
        for i, (key, (shape, dtype, _, _)) in enumerate(cases.items()):
            d = f[prefix + key]
            if d.shape != shape:
                raise AssertionError(f"h5py: {key} has shape {d.shape}, want {shape}")
            got = torch.from_numpy(d[()]).to(dtype)  # h5py reads bf16 as float32, exactly
            expect_equal(got, ref(shape, dtype, base=100 * i), f"h5py {key}")


def case_dtensor_save_state_dict(d, mesh1, mesh2):
    cases = dtensor_cases(mesh1, mesh2)
    path = os.path.join(d, "dtensor_sd.h5")
    sc.save_state_dict({"model": dtensor_state(cases, "save")}, path)
    check_h5(path, cases, "model.")
    target = {"model": dtensor_state(cases, "load", fill=False)}
    sc.load_state_dict(target, path)
    check_dtensors(cases, target["model"])


def case_dtensor_dcp(d, mesh1, mesh2):
    cases = dtensor_cases(mesh1, mesh2)
    path = os.path.join(d, "dtensor_dcp.h5")
    dcp.save({"model": dtensor_state(cases, "save")}, storage_writer=Writer(path))
    check_h5(path, cases, "model.")
    target = {"model": dtensor_state(cases, "load", fill=False)}
    dcp.load(target, storage_reader=Reader(path))
    check_dtensors(cases, target["model"])
    # And the other way round: save_state_dict's checkpoint through the Reader, DCP's through load_state_dict.
    target = {"model": dtensor_state(cases, "load", fill=False)}
    dcp.load(target, storage_reader=Reader(os.path.join(d, "dtensor_sd.h5")))
    check_dtensors(cases, target["model"])
    target = {"model": dtensor_state(cases, "load", fill=False)}
    sc.load_state_dict(target, path)
    check_dtensors(cases, target["model"])


def case_dcp_async(d, mesh1, mesh2):
    cases = dtensor_cases(mesh1, mesh2)
    path = os.path.join(d, "dtensor_async.h5")
    state = {"model": dtensor_state(cases, "save")}
    future = dcp.async_save(state, storage_writer=Writer(path))
    future.result()
    check_h5(path, cases, "model.")
    target = {"model": dtensor_state(cases, "load", fill=False)}
    dcp.load(target, storage_reader=Reader(path))
    check_dtensors(cases, target["model"])


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))


def tp_model(mesh=None, seed=0):
    """Column- then row-parallel linears (Megatron's MLP) on `mesh`; a plain module without one."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    if mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def train(model, opt, steps=2):
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 6)
        loss = model(x).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def case_adam_plain(d, mesh1, mesh2):
    """A plain module and its Adam (every rank the same: replicas), with save_state_dict and DCP."""
    for how in ("sd", "dcp"):
        model = tiny_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95))
        train(model, opt)
        path = os.path.join(d, f"adam_plain_{how}.h5")
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "tag": "run-a", "flag": True,
                 "nothing": None}
        if how == "sd":
            sc.save_state_dict(state, path)
        else:
            dcp.save(state, storage_writer=Writer(path))
        if RANK == 0:
            with h5().File(path, "r") as f:
                want = {"model.0.weight": (8, 6), "model.1.num_batches_tracked": (), "model.1.running_mean": (8,)}
                if how == "sd":
                    want["optim.state.0.step"] = ()
                    want["optim.state.0.exp_avg"] = (8, 6)
                for k, shape in want.items():
                    if f[k].shape != shape:
                        raise AssertionError(f"{how}: h5py {k} has shape {f[k].shape}, want {shape}")
                if int(f["model.1.num_batches_tracked"][()]) != 2:
                    raise AssertionError("num_batches_tracked is not 2")
        model2 = tiny_model(seed=5)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
        if how == "sd":
            # The fresh optimizer has no state yet: load_state_dict gives it back as saved.
            loaded = sc.load_state_dict({"model": model2.state_dict(), "optim": opt2.state_dict()}, path)
            if loaded["epoch"] != 3 or loaded["tag"] != "run-a" or loaded["flag"] is not True or "nothing" not in loaded \
                    or loaded["nothing"] is not None:
                raise AssertionError(f"values: {[(k, loaded[k]) for k in ('epoch', 'tag', 'flag', 'nothing')]}")
            betas = loaded["optim"]["param_groups"][0]["betas"]
            if not isinstance(betas, tuple) or betas != (0.8, 0.95):
                raise AssertionError(f"betas came back {betas!r}")
            opt2.load_state_dict(loaded["optim"])
        else:
            train(model2, opt2, 1)  # DCP loads into the state a model and optimizer have
            target = {"model": model2.state_dict(), "optim": opt2.state_dict(), "epoch": 0, "tag": "", "flag": False,
                      "nothing": None}
            dcp.load(target, storage_reader=Reader(path))
            opt2.load_state_dict(target["optim"])
            if target["epoch"] != 3 or target["tag"] != "run-a" or target["flag"] is not True:
                raise AssertionError(f"dcp values: {target['epoch']!r} {target['tag']!r} {target['flag']!r}")
        for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            expect_equal(b, a, f"{how} model {k}")
        s1, s2 = opt.state_dict(), opt2.state_dict()
        for pid in s1["state"]:
            for name, v in s1["state"][pid].items():
                expect_equal(s2["state"][pid][name], v, f"{how} optim state {pid} {name}")
        if s2["param_groups"][0]["lr"] != 0.01 or tuple(s2["param_groups"][0]["betas"]) != (0.8, 0.95):
            raise AssertionError(f"{how}: param_groups {s2['param_groups']}")
        # Training goes on the same from both.
        train(model, opt, 1)
        train(model2, opt2, 1)
        for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            expect_equal(b, a, f"{how} after a step {k}")


def case_adam_dtensor(d, mesh1, mesh2):
    """A tensor-parallel module (DTensor parameters) and its Adam, through get_state_dict, saved by
    save_state_dict and by dcp.save, resumed at other placements with set_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = tp_model(mesh1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, opt)
    msd, osd = get_state_dict(model, opt)
    for how in ("sd", "dcp"):
        path = os.path.join(d, f"adam_dtensor_{how}.h5")
        if how == "sd":
            sc.save_state_dict({"model": msd, "optim": osd}, path)
        else:
            dcp.save({"model": msd, "optim": osd}, storage_writer=Writer(path))
        if RANK == 0:
            with h5().File(path, "r") as f:
                if f["model.0.weight"].shape != (8, 6) or f["optim.state.0.weight.exp_avg"].shape != (8, 6):
                    raise AssertionError(f"{how}: global shapes {f['model.0.weight'].shape}")
        # Resume on the same mesh with the layers' parallel styles swapped is not a model; resume on
        # a plain (replicated) model instead: every rank loads the whole tensors.
        model2 = tp_model(seed=7)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
        train(model2, opt2, 1)
        m2, o2 = get_state_dict(model2, opt2)
        if how == "sd":
            loaded = sc.load_state_dict({"model": m2, "optim": o2}, path)
            m2, o2 = loaded["model"], loaded["optim"]
        else:
            target = {"model": m2, "optim": o2}
            dcp.load(target, storage_reader=Reader(path))
            m2, o2 = target["model"], target["optim"]
        set_state_dict(model2, opt2, model_state_dict=m2, optim_state_dict=o2)
        for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            expect_equal(full(b), full(a), f"{how} {k}")
        a_state, b_state = get_state_dict(model, opt)[1]["state"], get_state_dict(model2, opt2)[1]["state"]
        for k in a_state:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                expect_equal(full(b_state[k][name]), full(a_state[k][name]), f"{how} {k}.{name}")


def case_native_through_reader(d, mesh1, mesh2):
    """A native GTP checkpoint (a fused weight at TP 2 x GTP 2) read through the Reader by dataset
    names, its fused blocks included, into DTensors and plain tensors."""
    from support import reference, shard_of, spec_at
    tp, gtp = 2, 2
    tp_rank, gtp_rank = RANK // gtp, RANK % gtp
    p = sc.ShardedParam(spec_at(tp), gtp=gtp, align=0, tp_rank=tp_rank, gtp_rank=gtp_rank, dtype=torch.bfloat16)
    p.shard = shard_of(reference(tp, tp_rank), p)
    state = sc.StateDict()
    state.add(p)
    path = os.path.join(d, "native.h5")
    sc.save(state, path, group=dist.group.WORLD)
    whole = reference(1, 0)  # the TP 1 weight: its blocks' rows one after another
    spec = spec_at(1)
    key = spec.key
    target, start, want = {}, 0, {}
    for s in spec.sections:
        block = whole[start:start + s.rows]
        start += s.rows
        name = f"{key}.{s.name}" if s.name else key
        want[name] = block
        target[name] = distribute_tensor(torch.zeros_like(block), mesh1, [Shard(0)]) if s.rows >= WORLD \
            else torch.zeros_like(block)
    dcp.load(target, storage_reader=Reader(path))
    for name, block in want.items():
        expect_equal(full(target[name]), block, f"native {name}")


def case_torch_sharded_tensor(d, mesh1, mesh2):
    """torch's own ShardedTensor (ChunkShardingSpec over dim 0) saved at its global shape, loaded
    into a DTensor."""
    import warnings
    warnings.filterwarnings("ignore")
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(WORLD)])
    st = sharded_tensor.empty(spec, 10, 3)
    want = ref((10, 3), base=7)
    for shard in st.local_shards():
        o, n = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(want[o[0]:o[0] + n[0]])
    path = os.path.join(d, "sharded_tensor.h5")
    sc.save_state_dict({"st": st}, path)
    if RANK == 0:
        with h5().File(path, "r") as f:
            expect_equal(torch.from_numpy(f["st"][()]), want, "h5py st")
    target = {"st": distribute_tensor(torch.zeros(10, 3), mesh1, [Shard(1)])}
    sc.load_state_dict(target, path)
    expect_equal(target["st"].full_tensor(), want, "st as a DTensor")


def expect_failure(what, call, *needles, kinds=(Exception,)):
    try:
        call()
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        text = str(e)
        if not isinstance(e, kinds) and type(e).__name__ != "CheckpointException":
            raise AssertionError(f"{what}: raised {type(e).__name__}: {text}")
        for n in needles:
            if n not in text:
                raise AssertionError(f"{what}: the error does not name {n!r}: {type(e).__name__}: {text[:2000]}")
        return
    raise AssertionError(f"{what}: no error")


def case_bad_input(d, mesh1, mesh2):
    t = {"w": torch.ones(4, 2)}
    directory = os.path.join(d, "a_directory")
    if RANK == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    expect_failure("a Writer path that is a directory", lambda: dcp.save(t, storage_writer=Writer(directory)),
                   directory, "directory")
    if os.listdir(directory):
        raise AssertionError(f"the directory holds {os.listdir(directory)}")
    text = os.path.join(d, "not_a_checkpoint.h5")
    if RANK == 0:
        with open(text, "w") as f:
            f.write("hello\n")
    dist.barrier()
    expect_failure("a Reader path that is not a checkpoint", lambda: dcp.load(t, storage_reader=Reader(text)), text)
    good = os.path.join(d, "good.h5")
    dcp.save({"w": torch.ones(4, 2)}, storage_writer=Writer(good))
    expect_failure("a key the checkpoint lacks", lambda: dcp.load({"v": torch.ones(4, 2)}, storage_reader=Reader(good)),
                   "v")
    expect_failure("another shape", lambda: dcp.load({"w": torch.ones(4, 3)}, storage_reader=Reader(good)), "w")
    expect_failure("load_state_dict: a key the checkpoint lacks",
                   lambda: sc.load_state_dict({"v": torch.ones(4, 2)}, good), "v", good)
    expect_failure("load_state_dict: another shape", lambda: sc.load_state_dict({"w": torch.ones(4, 3)}, good),
                   "w", "(4, 3)", "(4, 2)")

    class Opaque:
        pass
    # An object on rank 1 only: every rank raises TypeError naming its key path; nothing is written.
    bad = os.path.join(d, "bad.h5")
    state = {"model": {"w": torch.ones(2)}, "extra": {"thing": Opaque() if RANK == 1 else 1}}
    expect_failure("an object leaf", lambda: sc.save_state_dict(state, bad), "extra.thing", "Opaque", kinds=(TypeError,))
    if os.path.exists(bad):
        raise AssertionError("save_state_dict with an object leaf left a file")
    expect_failure("a complex tensor", lambda: sc.save_state_dict({"z": torch.zeros(2, dtype=torch.complex64)}, bad),
                   "z", "complex64", kinds=(TypeError,))
    if os.path.exists(bad):
        raise AssertionError("save_state_dict with a complex tensor left a file")
    # Refusals on one rank that used to stall the others until the group's timeout (3 minutes here):
    # each fails every rank within seconds, naming the key, and writes nothing.
    import time
    for what, value, needles in (("a meta tensor", torch.empty(2, device="meta"), ["odd.t", "meta"]),
                                 ("a sparse tensor", torch.zeros(2, 2).to_sparse(), ["odd.t", "layout"])):
        state = {"model": {"w": torch.ones(2)}, "odd": {"t": value if RANK == 1 else torch.ones(2, 2)}}
        t0 = time.monotonic()
        expect_failure(f"{what} on rank 1", lambda: sc.save_state_dict(state, bad), *needles, kinds=(TypeError,))
        if time.monotonic() - t0 > 30 or os.path.exists(bad):
            raise AssertionError(f"{what} on rank 1: {time.monotonic() - t0:.1f} s, file left: {os.path.exists(bad)}")
    # The vote is the library's: a refusal rides in the save's (and the load's) first exchange, a
    # gather and its verdict, and a call without one takes no round more than the library's own.
    class Counting:
        def __init__(self):
            self.inner, self.calls = sc.TorchGroup(), 0

        def __getattr__(self, name):
            method = getattr(self.inner, name)
            if name not in ("all_gather_bytes", "broadcast_bytes", "all_gather_rows", "barrier"):
                return method

            def counted(*args):
                self.calls += 1
                return method(*args)
            return counted

    # (A load opens the file first, collectively: 4 collectives before its first exchange.)
    for what, state, call, calls in (
            ("save_state_dict", {"odd": {"t": torch.empty(2, device="meta") if RANK == 1 else torch.ones(2)}},
             lambda s, g: sc.save_state_dict(s, bad, group=g), 2),
            ("load_state_dict", {"w": torch.ones(4, 3) if RANK == 1 else torch.ones(4, 2)},
             lambda s, g: sc.load_state_dict(s, good, group=g), 4 + 2)):
        counting = Counting()
        expect_failure(f"{what}: a refusal on rank 1", lambda: call(state, counting),
                       *(["rank 1"] if RANK != 1 else []), kinds=(TypeError, ValueError))
        if counting.calls != calls:
            raise AssertionError(f"{what}: a refusal took {counting.calls} collectives, not {calls}")
    counting = Counting()
    sc.save_state_dict({"w": torch.ones(4, 2)}, bad, group=counting)
    if counting.calls != 4:  # the plan's gather and broadcast, the commit's (the pieces written in its gather)
        raise AssertionError(f"save_state_dict took {counting.calls} collectives, not the library's 4")
    counting = Counting()
    sc.load_state_dict({"w": torch.ones(4, 2)}, bad, group=counting)
    if counting.calls != 8:
        raise AssertionError(f"load_state_dict took {counting.calls} collectives, not the open's 4 and the load's 4")
    dist.barrier()
    if RANK == 0:
        os.unlink(bad)
    dist.barrier()
    # A value DCP cannot pickle, on rank 1 only: DCP's own FileSystemWriter fails both ranks at once.
    state = {"w": torch.ones(2), "hook": (lambda: 0) if RANK == 1 else 0}
    t0 = time.monotonic()
    expect_failure("an unpicklable value on rank 1", lambda: dcp.save(state, storage_writer=Writer(bad)))
    if time.monotonic() - t0 > 30 or os.path.exists(bad):
        raise AssertionError(f"an unpicklable value: {time.monotonic() - t0:.1f} s, file left: {os.path.exists(bad)}")


CASES = {name[5:]: f for name, f in globals().items() if name.startswith("case_")}


def main():
    d = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=3))
    mesh1 = init_device_mesh("cpu", (WORLD,))
    mesh2 = init_device_mesh("cpu", (2, WORLD // 2))
    run_cases(CASES, d, RANK, mesh1, mesh2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
