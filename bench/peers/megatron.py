"""Megatron-core's torch_dist backend against shardckpt's under the same dist_checkpointing.save /
load calls (megatron-core 0.16 or 0.19): one gloo job (4 processes by default) at TP 2 x DP (world / 2)
holding the storage phase's model (bench/peers/storage.py: GPT-2 small's shapes, bf16 weights, f32
norms, Adam's two f32 moments) as Megatron's layers describe it: layer-stacked ShardedTensors
(prepend_axis_num=1, one per layer), column-parallel weights split on dim 1, row-parallel ones on
their last dim, norms replicated over TP, everything replicated over DP (replica_id (0, 0, dp)).
Sides: "torch_dist" (Megatron's default), "torch_dist_fp" (the same wrapped in
FullyParallelSaveStrategyWrapper over the DP group, as megatron/training's --ckpt-fully-parallel-save
does) and "shardckpt"; on 0.18 and later also "torch_dist_async" and "shardckpt_async": the same
saves with async_sharded_save=True through Megatron's AsyncCallsQueue (async_strategy "mcore"),
timed whole (to the finalization) and, as megatron_<side>_blocking, the part the caller waits for
(dist_checkpointing.save and schedule_async_request, the slowest rank's). Interleaved rounds, the
page cache dropped before each phase; rank 0 times every phase from a barrier to a barrier."""
import dataclasses
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None  # torch_dist calls these on CPU too
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy  # noqa: E402
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper  # noqa: E402

import shardckpt.megatron as scm  # noqa: E402

from . import storage, system  # noqa: E402

SIDES = ("torch_dist", "torch_dist_fp", "shardckpt") + (() if scm.REGISTRY else ("torch_dist_async", "shardckpt_async"))
TP = 2


def tensors(shape, tp_rank, dp_rank, fill):
    """(state key, ShardedTensor) of every weight and Adam moment: layer-stacked as Megatron stacks them."""
    layers, hidden = shape
    out = []
    rows_of = {"attn.qkv.weight": 1, "mlp.up.weight": 1, "attn.out.weight": 2, "mlp.down.weight": 2}
    for i, (name, gshape, dtype, _) in enumerate(storage.params(shape)):
        if name.startswith("layers."):
            layer, base = int(name.split(".")[1]), name.split(".", 2)[2]
            key, stacked = f"decoder.layers.{base}", (layers,) + gshape
            split = rows_of.get(base)  # axis in the stacked global shape, or None (a replicated norm)
            prepend = ((0, layer, layers),)
        else:
            layer, key, stacked, prepend = None, name, gshape, ()
            split = 0 if name == "embed.weight" else None  # vocabulary-parallel, or a replicated norm
        local = list(stacked[len(prepend):])
        offsets = prepend
        if split is not None:
            a = split - len(prepend)
            local[a] = stacked[split] // TP
            offsets = prepend + ((split, tp_rank, TP),)
        for kind, dt, scale in (("weight", dtype, 1.0), ("exp_avg", torch.float32, 0.01),
                                ("exp_avg_sq", torch.float32, 1e-4)):
            t = torch.empty(local, dtype=dt)
            if fill:
                # A replica's values are the same on every rank that holds it.
                part = tp_rank if split is not None else 0
                t.normal_(0.0, scale, generator=torch.Generator().manual_seed(1000 * i + 7 * part + len(kind)))
            else:
                t.reshape(-1).view(torch.uint8).fill_(0xff)
            full_key = key if kind == "weight" else f"optimizer.state.{kind}.{key}"
            replica = (0, 0, dp_rank) if split is not None else (0, tp_rank, dp_rank)
            out.append((f"{full_key}.{layer}", ShardedTensor.from_rank_offsets(
                full_key, t, *offsets, replica_id=replica, prepend_axis_num=len(prepend))))
    return out


def fresh(state):
    """New ShardedTensors over the same tensors, as a trainer's sharded_state_dict() makes them for
    each save: torch_dist changes the ShardedTensors it is handed (their data gets the prepended axes)."""
    return {k: dataclasses.replace(sh) for k, sh in state.items()}


class Job(system.Rounds):
    def __init__(self, shape, directory, isolated):
        self.rank, self.world, self.dir = dist.get_rank(), dist.get_world_size(), directory
        self.tp_rank, self.dp_rank = self.rank % TP, self.rank // TP
        self.source = dict(tensors(shape, self.tp_rank, self.dp_rank, fill=True))
        self.dest = dict(tensors(shape, self.tp_rank, self.dp_rank, fill=False))
        # The DP group of this TP rank (FullyParallelSaveStrategyWrapper's parallelization group).
        groups = [dist.new_group(list(range(t, self.world, TP))) for t in range(TP)]
        self.dp_group = groups[self.tp_rank]
        self.meter, self.records, self.mismatches = system.PeakMeter(), {}, []
        self.isolated = isolated
        self.queue = None
        self.async_strategy = scm.SaveStrategy()  # one per job, as a trainer keeps it (its saver's budget)

    def path(self, side):
        return os.path.join(self.dir, f"megatron-{side}")

    def strategy(self, side):
        if side == "shardckpt":
            return scm.SaveStrategy()
        if side == "shardckpt_async":
            return self.async_strategy
        base = get_default_save_sharded_strategy()
        if side == "torch_dist_async":
            return base
        return base if side == "torch_dist" else FullyParallelSaveStrategyWrapper(base, self.dp_group)

    def local_bytes(self):
        return sum(sh.data.nbytes for sh in self.source.values())

    def save(self, side):
        if side.endswith("_async"):
            return self.save_async(side)
        self.timed(f"megatron_{side}_save", lambda: dist_checkpointing.save(
            fresh(self.source), self.path(side), sharded_strategy=self.strategy(side)), old=self.path(side),
            recreate=True)  # Megatron saves into an existing directory

    def save_async(self, side):
        """An async save through Megatron's queue: the whole phase timed to the finalization, and what
        the caller waits for (save and schedule) on the slowest rank."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        if self.queue is None:
            self.queue = AsyncCallsQueue()
        blocked = []

        def fn():
            t0 = time.perf_counter()
            request = dist_checkpointing.save(fresh(self.source), self.path(side), sharded_strategy=self.strategy(side),
                                              async_sharded_save=True, async_strategy="mcore")
            self.queue.schedule_async_request(request)
            blocked.append(time.perf_counter() - t0)
            self.queue.maybe_finalize_async_calls(blocking=True)
        self.timed(f"megatron_{side}_save", fn, old=self.path(side), recreate=True)
        slowest = torch.tensor([blocked[0]], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        self.records.setdefault(f"megatron_{side}_blocking", []).append(
            {"seconds": float(slowest.item()), "peak_extra": 0, "peak": 0})

    def load(self, side, timed=True):
        for sh in self.dest.values():
            sh.data.reshape(-1).view(torch.uint8).fill_(0xff)
        strategy = {"sharded_strategy": scm.LoadStrategy()} if side.startswith("shardckpt") else {}
        fn = lambda: dist_checkpointing.load(fresh(self.dest), self.path(side), **strategy)  # noqa: E731
        self.timed(f"megatron_{side}_load", fn) if timed else fn()
        for k, sh in self.source.items():
            if not torch.equal(sh.data.view(torch.uint8), self.dest[k].data.view(torch.uint8)):
                self.mismatches.append(f"megatron {side} load: {sh.key}")
                break

    def run(self, sides, rounds, read_rounds):
        # The wrapper's and the async sides' checkpoints are their base's format: their loads are its.
        return super().run(sides, rounds, read_rounds, loads=[s for s in sides if s in ("torch_dist", "shardckpt")])


def main(size_bytes, directory, rounds, read_rounds, out_path, sides=SIDES):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        shape = storage.shape_for(size_bytes)
        job = Job(shape, directory, isolated=len(sides) == 1)
        everyone = job.run(tuple(sides), rounds, read_rounds)
        if job.rank == 0:
            with open(out_path, "w") as f:
                json.dump(storage.merge(everyone, job, sides) | {"layers": shape[0], "hidden": shape[1],
                                                         "bytes": storage.state_bytes(shape) - 4 * len(
                                                             storage.params(shape))}, f)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    dist.destroy_process_group()
