"""DCP's own storage against shardckpt's, under the same dcp.save / dcp.load calls: one gloo job
(4 processes by default) holding a realistic mixed training state of DTensors, saved and loaded by
DCP through its FileSystemWriter / FileSystemReader (a directory, one file per rank) and through
shardckpt.dcp.Writer / Reader (one shardckpt checkpoint), in interleaved rounds with the page cache
dropped before each phase. Rank 0 times every phase from a barrier to a barrier.

The state, the way a trainer of a tensor-parallel model hands it to DCP ({"model": ..., "optim":
...} as get_state_dict gives it): GPT-2 small's shapes (vocabulary 50,257, hidden 768, MLP 4x; as
many layers as bring the bytes closest to the target: 10 for 1 GiB, the hidden size halved for
states below one layer's), every weight a DTensor Shard(0) over the
job's 1-D mesh in bf16 (the embedding's rows uneven over the ranks, as torch.chunk cuts them),
every norm a replicated f32 DTensor; Adam's state for each parameter: exp_avg and exp_avg_sq in
f32 at the parameter's placement, its step a 0-d f32 tensor, and param_groups (floats, a tuple, the
parameters' names), which DCP pickles as bytes items.

`sides`: both (the timed, interleaved rounds), or one of them alone (one save and one load, for
the high-water mark of a process that ran only that storage: ru_maxrss)."""
import json
import os
import sys
import traceback
from math import prod

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import system

SIDES = ("fs", "shardckpt")
VOCAB, HIDDEN, MLP = 50257, 768, 4


def layer_shapes(layer, hidden):
    p = f"layers.{layer}."
    return [(p + "attn_norm.weight", (hidden,), torch.float32, "replicated"),
            (p + "attn.qkv.weight", (3 * hidden, hidden), torch.bfloat16, "rows"),
            (p + "attn.out.weight", (hidden, hidden), torch.bfloat16, "rows"),
            (p + "mlp_norm.weight", (hidden,), torch.float32, "replicated"),
            (p + "mlp.up.weight", (MLP * hidden, hidden), torch.bfloat16, "rows"),
            (p + "mlp.down.weight", (hidden, MLP * hidden), torch.bfloat16, "rows")]


def params(shape):
    """(name, global shape, dtype, placement) of every parameter of `shape` (layers, hidden)."""
    layers, hidden = shape
    out = [("embed.weight", (VOCAB, hidden), torch.bfloat16, "rows")]
    for i in range(layers):
        out += layer_shapes(i, hidden)
    return out + [("final_norm.weight", (hidden,), torch.float32, "replicated")]


def state_bytes(shape):
    """The bytes of the global state: weights in their dtype, two f32 moments each, the steps."""
    return sum(prod(s) * (dtype.itemsize + 8) + 4 for _, s, dtype, _ in params(shape))


def shape_for(target_bytes):
    """(layers, hidden): the hidden size halved until one layer fits, then the layers closest."""
    hidden = HIDDEN
    while hidden > 48 and state_bytes((1, hidden)) > target_bytes:
        hidden //= 2
    return min(((n, hidden) for n in range(1, 257)), key=lambda s: abs(state_bytes(s) - target_bytes))


def _rows(rows, world, rank):
    """torch.chunk's cut of `rows` over `world` ranks: (start, count) of `rank`'s."""
    size = -(-rows // world)
    start = min(rank * size, rows)
    return start, max(0, min(rows, start + size) - start)


class State:
    """A rank's state dict of DTensors, its values from a generator seeded by the tensor's name and
    the rank (filled), or a destination of the same placements (poisoned before each load)."""

    def __init__(self, shape, mesh, fill):
        self.mesh, rank, world = mesh, dist.get_rank(), dist.get_world_size()
        model, state, names = {}, {}, []
        for i, (name, shape, dtype, placement) in enumerate(params(shape)):
            names.append(name)
            gen = torch.Generator().manual_seed(1000 * i + rank)
            if placement == "rows":
                _, count = _rows(shape[0], world, rank)
                local_shape, placements = (count,) + shape[1:], [Shard(0)]
            else:
                local_shape, placements = shape, [Replicate()]
                gen.manual_seed(1000 * i)  # a replica's values are the same on every rank
            stride = tuple(prod(shape[k + 1:]) for k in range(len(shape)))

            def tensor(dt, scale=1.0):  # filled in place: no temporary raises the high-water mark
                local = torch.empty(local_shape, dtype=dt)
                if fill:
                    local.normal_(0.0, scale, generator=gen)
                return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                          stride=stride)
            model[name] = tensor(dtype)
            state[name] = {"exp_avg": tensor(torch.float32, 0.01), "exp_avg_sq": tensor(torch.float32, 1e-4),
                           "step": torch.tensor(float(1000 if fill else 0))}
        self.names = names
        self.sd = {"model": model, "optim": {"state": state, "param_groups": self.groups(fill)}}

    def groups(self, fill):
        """Adam's param_groups; a destination's hold other values of the same structure."""
        return [{"lr": 3e-4 if fill else -1.0, "betas": (0.9, 0.95) if fill else (0.0, 0.0), "eps": 1e-8 if fill else 0.0,
                 "weight_decay": 0.1 if fill else 0.0, "params": self.names if fill else ["?"] * len(self.names)}]

    def tensors(self):
        for name, t in self.sd["model"].items():
            yield f"model.{name}", t
            for k, v in self.sd["optim"]["state"][name].items():
                yield f"optim.{name}.{k}", v

    def local_bytes(self):
        return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for _, t in self.tensors())

    def poison(self):
        for _, t in self.tensors():
            (t.to_local() if isinstance(t, DTensor) else t).reshape(-1).view(torch.uint8).fill_(0xff)
        self.sd["optim"]["param_groups"] = self.groups(False)

    def mismatches(self, want):
        bad = []
        got_tensors = dict(self.tensors())
        for key, w in want.tensors():
            g = got_tensors[key]
            g, w = (g.to_local(), w.to_local()) if isinstance(w, DTensor) else (g, w)
            if not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
                bad.append(key)
        if self.sd["optim"]["param_groups"] != want.sd["optim"]["param_groups"]:
            bad.append("optim.param_groups")
        return bad


def writer(side, path):
    if side == "fs":
        return dcp.FileSystemWriter(path)  # its defaults: one file per rank, one thread, fsynced
    from shardckpt.dcp import Writer
    return Writer(path)  # its defaults: raw writes, checksums


def reader(side, path):
    if side == "fs":
        return dcp.FileSystemReader(path)
    from shardckpt.dcp import Reader
    return Reader(path)  # its defaults: checksums verified


class Job(system.Rounds):
    def __init__(self, shape, directory, isolated):
        self.rank, self.dir = dist.get_rank(), directory
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.source, self.dest = State(shape, mesh, fill=True), State(shape, mesh, fill=False)
        self.dest.poison()  # resident before the first phase, as a trainer's tensors are
        self.meter, self.records, self.mismatches = system.PeakMeter(), {}, []
        # A storage alone: the process's own high-water mark (ru_maxrss), never reset by a phase.
        self.isolated = isolated

    def path(self, side):
        return os.path.join(self.dir, {"fs": "storage-fs", "shardckpt": "storage-shardckpt.h5"}[side])

    def local_bytes(self):
        return self.source.local_bytes()

    def save(self, side):
        self.timed(f"storage_{side}_save", lambda: dcp.save(self.source.sd, storage_writer=writer(side, self.path(side))),
                   old=self.path(side))

    def load(self, side, timed=True):
        self.dest.poison()
        fn = lambda: dcp.load(self.dest.sd, storage_reader=reader(side, self.path(side)))  # noqa: E731
        if timed:
            self.timed(f"storage_{side}_load", fn)
        else:
            fn()
        self.mismatches += [f"{side} storage load: {k}" for k in self.dest.mismatches(self.source)[:5]]


def merge(everyone, job, sides):
    """Rank 0's clock, every rank's memory (the largest); checkpoints on disk."""
    out = {"phases": {}, "mismatches": [m for e in everyone for m in e["mismatches"]],
           "ranks": len(everyone), "local_bytes": [e["local_bytes"] for e in everyone],
           "maxrss": max(e["maxrss"] for e in everyone),
           "maxrss_extra": max(e["maxrss"] - e["rss_before"] for e in everyone),
           "hwm_before": max(e["hwm_before"] for e in everyone), "rss_before": max(e["rss_before"] for e in everyone),
           "peak_method": job.meter.method()}
    for name, rounds in everyone[0]["records"].items():
        out["phases"][name] = [{"seconds": r["seconds"],
                                "peak_extra": max(e["records"][name][i]["peak_extra"] for e in everyone),
                                "peak": max(e["records"][name][i]["peak"] for e in everyone)}
                               for i, r in enumerate(rounds)]
    out["disk"] = {side: dict(zip(("bytes", "files"), system.on_disk(job.path(side)))) for side in sides}
    return out


def main(size_bytes, directory, rounds, read_rounds, out_path, sides=SIDES):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        shape = shape_for(size_bytes)
        job = Job(shape, directory, isolated=len(sides) == 1)
        everyone = job.run(tuple(sides), rounds, read_rounds)
        if job.rank == 0:
            with open(out_path, "w") as f:
                json.dump(merge(everyone, job, sides) | {"layers": shape[0], "hidden": shape[1],
                                                         "bytes": state_bytes(shape)}, f)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # the other ranks are stopped by the launcher
    dist.destroy_process_group()
