"""One process, consolidated weights (TP 1 x GTP 1): safetensors' save_file and load_file of every
parameter's whole weight (fused blocks joined in row order), against shardckpt's save and read of the
same tensors; and both into tensors that exist before the load, as a model's parameters do
(load_file and copy_, as safetensors.torch.load_model does, against shardckpt's load_into).
Interleaved rounds, which side goes first alternating, the page cache dropped before each. The
baseline of the reads: shardckpt's file mapped and its pages brought in (MADV_POPULATE_READ), nothing
checked or made of them: the pace of this disk through a mapping."""
import json
import mmap
import os
import time

import torch
from safetensors.torch import load_file, save_file

import shardckpt as sc
from . import model, system

WHOLE = model.Layout(1, 1, 1)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python names it from 3.13


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def touch(tensors):
    """Reads one byte of every page, so that memory a loader only mapped is read before the clock
    stops: what using the weights would cost (safetensors' load_file maps the file)."""
    return sum(int(t.view(-1).view(torch.uint8)[::4096].sum()) for t in tensors.values())


class Single:
    def __init__(self, config, directory):
        self.dir, self.meter, self.records, self.mismatches = directory, system.PeakMeter(), {}, []
        whole = model.rank_model(config, WHOLE, 0)
        for rp in whole.params:
            assert rp.shard.shape[0] == sum(p.rows() for p in rp.pieces), "GTP 1 holds no pad rows"
        self.tensors = {rp.spec.key: rp.shard for rp in whole.params}
        self.state = sc.StateDict()
        for rp in whole.params:
            self.state.add(sc.ShardedParam(rp.spec, gtp=1, align=1, tp_rank=0, gtp_rank=0, shard=rp.shard))
        self.dest = model.rank_model(config, WHOLE, 0, fill=False)  # a model's parameters, touched once
        self.into = sc.StateDict()
        for rp in self.dest.params:
            self.into.add(sc.ShardedParam(rp.spec, gtp=1, align=1, tp_rank=0, gtp_rank=0, shard=rp.shard))
        self.paths = {"safetensors": os.path.join(directory, "model.safetensors"),
                      "shardckpt": os.path.join(directory, "whole.h5")}

    def timed(self, name, fn, remove=None):
        if remove:
            system.remove(remove)
        system.cold(self.dir)
        self.meter.begin()
        t0 = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - t0
        extra, peak = self.meter.end()
        self.records.setdefault(name, []).append({"seconds": seconds, "peak_extra": extra, "peak": peak})
        return out

    def save_safetensors(self):
        save_file(self.tensors, self.paths["safetensors"])
        fsync(self.paths["safetensors"])  # shardckpt's save is durable when it returns: so is this one

    def save_shardckpt(self):
        sc.save(self.state, self.paths["shardckpt"])

    def load(self, side):
        def load_safetensors():
            loaded = load_file(self.paths["safetensors"])
            touch(loaded)
            return loaded
        fn = load_safetensors if side == "safetensors" else lambda: sc.read(self.paths["shardckpt"])
        loaded = self.timed(f"{side}_{'load' if side == 'safetensors' else 'read'}", fn)
        for key, want in self.tensors.items():
            got = loaded.get(key)
            if got is None or got.shape != want.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                self.mismatches.append(f"{side}: {key} differs from what was saved")
        del loaded

    def populate(self):
        """The baseline of the reads: the pages of shardckpt's file brought into a private mapping of
        it in file order (MADV_POPULATE_READ; a read of one byte of each page before Linux 5.14)."""
        def bring_in():
            with open(self.paths["shardckpt"], "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                                                   prot=mmap.PROT_READ) as m:
                try:
                    m.madvise(MADV_POPULATE_READ)
                except OSError:
                    return sum(m[::mmap.PAGESIZE])
        self.timed("mapping_populate", bring_in)

    def load_into(self, side):
        def safetensors_into():
            loaded = load_file(self.paths["safetensors"])
            for rp in self.dest.params:
                rp.shard.copy_(loaded[rp.spec.key])
        model.poison(self.dest)
        fn = safetensors_into if side == "safetensors" else lambda: sc.load_into(self.paths["shardckpt"], self.into)
        self.timed(f"{side}_single_load_into", fn)
        for rp in self.dest.params:
            if not torch.equal(rp.shard.view(torch.int16), self.tensors[rp.spec.key].view(torch.int16)):
                self.mismatches.append(f"{side} into existing tensors: {rp.spec.key} differs from what was saved")

    def run(self, rounds, read_rounds):
        for _ in range(rounds):
            self.timed("safetensors_save", self.save_safetensors, remove=self.paths["safetensors"])
            self.timed("shardckpt_single_save", self.save_shardckpt, remove=self.paths["shardckpt"])
        for i in range(read_rounds):
            sides = ("safetensors", "shardckpt") if i % 2 == 0 else ("shardckpt", "safetensors")
            for side in sides:
                self.load(side)
            self.populate()
            for side in sides:
                self.load_into(side)
        return {"phases": self.records, "mismatches": self.mismatches,
                "disk": {side: dict(zip(("bytes", "files"), system.on_disk(p))) for side, p in self.paths.items()}}


def main(size_bytes, directory, rounds, read_rounds, out_path):
    result = Single(model.bench_config(size_bytes), directory).run(rounds, read_rounds)
    with open(out_path, "w") as f:
        json.dump(result, f)
