"""One process of the gloo job: its shards at TP 2 x GTP 4 (alignment 32), saved, loaded in place,
resharded at TP 1 x GTP 8 (alignment 16) and saved in the background, by DCP and by shardckpt, in
interleaved rounds with the page cache dropped before each phase. Rank 0 times every phase from a
barrier to a barrier and writes what every rank measured to a JSON file."""
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

import shardckpt as sc
from . import dcp_side, model, shardckpt_side, system

SAVE = model.Layout(2, 4, 32)
RESHARD = model.Layout(1, 8, 16)


class Job:
    def __init__(self, config, directory):
        self.rank, self.dir = dist.get_rank(), directory
        self.config, self.meter = config, system.PeakMeter()
        self.records = {}
        self.model = model.rank_model(config, SAVE, self.rank)
        self.dest = model.rank_model(config, SAVE, self.rank, fill=False)
        self.dest_reshard = model.rank_model(config, RESHARD, self.rank, fill=False)
        self.expected_reshard = model.rank_model(config, RESHARD, self.rank)
        save_pieces, reshard_pieces = model.all_pieces(config, SAVE), model.all_pieces(config, RESHARD)
        self.dcp = {"save": dcp_side.state_dict(self.model, save_pieces, saving=True),
                    "load": dcp_side.state_dict(self.dest, save_pieces, saving=False),
                    "reshard": dcp_side.state_dict(self.dest_reshard, reshard_pieces, saving=False)}
        self.sc = {"save": shardckpt_side.state_dict(self.model), "load": shardckpt_side.state_dict(self.dest),
                   "reshard": shardckpt_side.state_dict(self.dest_reshard)}
        self.group = sc.TorchGroup()
        self.savers = {"dcp": dcp_side.AsyncSaver(dist.new_group(backend="gloo")),
                       "shardckpt": shardckpt_side.AsyncSaver(self.group)}
        self.mismatches = []

    def path(self, side, what):
        return os.path.join(self.dir, {"dcp": f"dcp-{what}", "shardckpt": f"shardckpt-{what}.h5"}[side])

    def _barrier(self):
        dist.barrier()

    def _prepare(self, remove=None):
        """Untimed: the last round's checkpoint removed, everything synced, the page cache dropped."""
        self._barrier()
        if self.rank == 0:
            if remove:
                system.remove(remove)
            system.cold(self.dir)
        self._barrier()
        self.meter.begin()
        self._barrier()

    def _record(self, name, **seconds):
        extra, peak = self.meter.end()
        self.records.setdefault(name, []).append(dict(seconds, peak_extra=extra, peak=peak))

    def timed(self, name, fn, remove=None):
        self._prepare(remove)
        t0 = time.perf_counter()
        fn()
        self._barrier()
        self._record(name, seconds=time.perf_counter() - t0)

    def timed_async(self, side, state):
        """Blocking: from a barrier to a barrier after every rank's call returned; total: until
        every rank's save completed."""
        path = self.path(side, "async")
        self._prepare(path)
        t0 = time.perf_counter()
        pending = self.savers[side].save_async(state, path)
        self._barrier()
        blocking = time.perf_counter() - t0
        pending.wait() if side == "shardckpt" else pending.result()
        self._barrier()
        self._record(f"{side}_async", seconds=blocking, total=time.perf_counter() - t0)

    def write_round(self):
        self.timed("dcp_save", lambda: dcp_side.save(self.dcp["save"], self.path("dcp", "save")),
                   remove=self.path("dcp", "save"))
        self.timed("shardckpt_save", lambda: shardckpt_side.save(self.sc["save"], self.path("shardckpt", "save"),
                                                                 self.group), remove=self.path("shardckpt", "save"))
        self.timed_async("dcp", self.dcp["save"])
        self.timed_async("shardckpt", self.sc["save"])

    def load(self, side, what, source, timed=True):
        """One load (poisoned destinations first), checked against the values saved."""
        dest, expected = (self.dest, self.model) if what == "load" else (self.dest_reshard, self.expected_reshard)
        model.poison(dest)
        path = self.path(side, source)
        if side == "dcp":
            fn = lambda: dcp_side.load(self.dcp[what], path)  # noqa: E731
        else:
            fn = lambda: shardckpt_side.load(self.sc[what], path, self.group)  # noqa: E731
        if timed:
            self.timed(f"{side}_{what}", fn)
        else:
            fn()
        bad = model.mismatches(dest, expected, pad_rows_zero=(side == "shardckpt"))
        self.mismatches += [f"{side} {what} of {source}: {b}" for b in bad]

    def read_round(self):
        for what in ("load", "reshard"):
            for side in ("dcp", "shardckpt"):
                self.load(side, what, "save")

    def staging_bytes(self):
        return {side: saver.staging_bytes() for side, saver in self.savers.items()}

    def snapshot(self, side, state):
        """Untimed: a background save whose shards change as soon as the call returns (every bit
        inverted, and back once it is done), so that its checkpoint, loaded and checked below, must
        hold the values of the call."""
        path = self.path(side, "async")
        self._prepare(path)
        pending = self.savers[side].save_async(state, path)
        for p in self.model.params:
            p.shard.view(torch.int16).bitwise_not_()
        pending.wait() if side == "shardckpt" else pending.result()
        for p in self.model.params:
            p.shard.view(torch.int16).bitwise_not_()
        self._barrier()
        self.meter.end()

    def run(self, rounds, read_rounds):
        for _ in range(rounds):
            self.write_round()
        self.snapshot("dcp", self.dcp["save"])
        self.snapshot("shardckpt", self.sc["save"])
        for side in ("dcp", "shardckpt"):  # what the background saves wrote
            self.load(side, "load", "async", timed=False)
        for side in ("dcp", "shardckpt"):  # one untimed read of the fresh checkpoints
            self.load(side, "load", "save", timed=False)
        for _ in range(read_rounds):
            self.read_round()
        mine = {"records": self.records, "mismatches": self.mismatches, "staging": self.staging_bytes(),
                "shard_bytes": self.model.shard_bytes(), "peak_method": self.meter.method()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for saver in self.savers.values():
            saver.close()
        return everyone


def merge(everyone, job):
    """Rank 0's clock, every rank's memory; checkpoints on disk."""
    out = {"phases": {}, "mismatches": [m for e in everyone for m in e["mismatches"]]}
    for name, rounds in everyone[0]["records"].items():
        phase = []
        for i, r in enumerate(rounds):
            peaks = [e["records"][name][i] for e in everyone]
            phase.append({k: v for k, v in r.items() if k not in ("peak_extra", "peak")} |
                         {"peak_extra": max(p["peak_extra"] for p in peaks), "peak": max(p["peak"] for p in peaks)})
        out["phases"][name] = phase
    out["disk"] = {side: dict(zip(("bytes", "files"), system.on_disk(job.path(side, "save"))))
                   for side in ("dcp", "shardckpt")}
    out["staging"] = {side: sum(e["staging"][side] for e in everyone) for side in ("dcp", "shardckpt")}
    out["shard_bytes"] = sum(e["shard_bytes"] for e in everyone)
    out["peak_method"] = everyone[0]["peak_method"]
    return out


def main(size_bytes, directory, rounds, read_rounds, out_path):
    torch.set_num_threads(1)  # 8 processes on this machine's cores
    # torch 2.x warns at every use that ShardedTensor is deprecated for DTensor (dcp_side.py: why not)
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
    dist.init_process_group("gloo")
    try:
        job = Job(model.bench_config(size_bytes), directory)
        everyone = job.run(rounds, read_rounds)
        if job.rank == 0:
            with open(out_path, "w") as f:
                json.dump(merge(everyone, job), f)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # the other ranks are stopped by the launcher
    dist.destroy_process_group()
