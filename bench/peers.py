#!/usr/bin/env python3
"""shardckpt beside the peers a user would pick instead (docs/performance.md, "Beside PyTorch DCP
and safetensors"), in one run on one machine, on the same sharded state:

  - PyTorch Distributed Checkpoint (DCP, what Megatron's dist_checkpointing saves through) and
    shardckpt, in the same 8 gloo processes holding the bench model's GTP shards at TP 2 x GTP 4
    (alignment 32) as torch tensors: save, load in place, reshard at TP 1 x GTP 8 (alignment 16),
    and the blocking time of an async save;
  - safetensors and shardckpt in one process, on the same tensors consolidated at TP 1 x GTP 1;
  - DCP's own storage (FileSystemWriter / FileSystemReader) against shardckpt's (shardckpt.dcp
    Writer / Reader) under the same dcp.save / dcp.load, in a gloo job of 4 processes holding a
    mixed training state of DTensors (bf16 weights, f32 norms, Adam's state): bench/peers/storage.py;
  - Megatron-core's torch_dist backend (alone, and in FullyParallelSaveStrategyWrapper) against the
    "shardckpt" backend under the same dist_checkpointing.save / load, on the same state as Megatron's
    layer-stacked ShardedTensors at TP 2 x DP 2: bench/peers/megatron.py;
  - shardckpt.megatron.no_gather against Megatron's own gather of a GTP-sharded MambaMixer in_proj
    (61,760 x 1,024 bf16 TP-local at GTP 8 over 8 gloo processes), both saved by the "shardckpt"
    backend: bench/peers/mamba.py.

Run it with the Python of the peers' environment (scripts/setup.sh --peers):

    build/peers-venv/bin/python bench/peers.py [--size-mib 1024] [--repeat 7] [--json]
    build/peers-venv/bin/python bench/peers.py --only storage [--storage-mib 1024] [--storage-ranks 4]
    build/peers-venv/bin/python bench/peers.py --only megatron [--storage-mib 1024] [--storage-ranks 4]
    build/peers-venv/bin/python bench/peers.py --only mamba [--mamba-ranks 8] [--repeat 3]

The exit code is 0 whatever the figures, 1 if a loaded value differs from what was saved, 2 on an
error.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
# What a run writes into its directory (and removes without --keep).
OUTPUTS = ("job.json", "single.json", "dcp-save", "dcp-async", "shardckpt-save.h5", "shardckpt-async.h5",
           "model.safetensors", "whole.h5", "storage.json", "storage-fs.json", "storage-shardckpt.json",
           "storage-fs", "storage-shardckpt.h5", "megatron.json", "megatron-torch_dist.json",
           "megatron-shardckpt.json", "megatron-torch_dist", "megatron-torch_dist_fp", "megatron-shardckpt",
           "megatron-torch_dist_async", "megatron-shardckpt_async", "mamba.json", "mamba-gather", "mamba-no_gather")


def arguments(argv):
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    a.add_argument("--size-mib", type=int, default=1024, help="model size (default 1024: 1 GiB)")
    a.add_argument("--repeat", type=int, default=7, help="rounds of writes (default 7)")
    a.add_argument("--read-repeat", type=int, default=7, help="rounds of reads (default 7)")
    a.add_argument("--dir", help="where the checkpoints go (default: a new directory in /tmp)")
    a.add_argument("--json", action="store_true", help="one JSON object: every figure, its spread and target")
    a.add_argument("--keep", action="store_true", help="keep the checkpoints")
    a.add_argument("--warm-cache", action="store_true",
                   help="keep the page cache (for profiling: what each side costs beside the disk)")
    a.add_argument("--only", choices=("peers", "storage", "megatron", "mamba"),
                   help="peers: DCP and safetensors against shardckpt only; storage: DCP's FileSystem storage\n"
                        "against shardckpt.dcp's Writer/Reader only; megatron: Megatron's torch_dist against\n"
                        "the shardckpt backend only; mamba: no_gather against Megatron's own gather of a GTP\n"
                        "Mamba in_proj (default: peers and storage; megatron needs megatron-core, mamba 0.19)")
    a.add_argument("--storage-mib", type=int, default=1024,
                   help="the storage and megatron phases' state (default 1024: 1 GiB)")
    a.add_argument("--storage-ranks", type=int, default=4,
                   help="the storage and megatron phases' gloo processes (default 4; megatron: even)")
    a.add_argument("--mamba-ranks", type=int, default=8,
                   help="the mamba phase's gloo processes, its GTP size (default 8)")
    a.add_argument("--part", choices=("job", "single", "storage", "megatron", "mamba"), help=argparse.SUPPRESS)  # internal: one side
    a.add_argument("--sides", default="fs,shardckpt", help=argparse.SUPPRESS)  # internal: the storage part's
    a.add_argument("--out", help=argparse.SUPPRESS)
    o = a.parse_args(argv)
    if not 1 <= o.size_mib <= 1 << 20 or not 1 <= o.repeat <= 100 or not 1 <= o.read_repeat <= 100:
        a.error("--size-mib is 1 to 1048576, --repeat and --read-repeat 1 to 100")
    if not 1 <= o.storage_mib <= 1 << 20 or not 1 <= o.storage_ranks <= 64:
        a.error("--storage-mib is 1 to 1048576, --storage-ranks 1 to 64")
    if not 2 <= o.mamba_ranks <= 64:
        a.error("--mamba-ranks is 2 to 64")
    return o


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_command(o, part, out, sides="fs,shardckpt", rounds=None):
    return [sys.executable, os.path.abspath(__file__), "--part", part, "--out", out, "--dir", o.dir,
            "--size-mib", str(o.size_mib), "--repeat", str(rounds or o.repeat),
            "--read-repeat", str(rounds or o.read_repeat), "--storage-mib", str(o.storage_mib), "--sides", sides]


def environment(**more):
    # One intra-op thread each; glibc's mmap threshold fixed at 1 MiB, as shardckpt-bench fixes it.
    return dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(MiB), **more)


def run_job(o, out, world=8, part="job", **more):
    """The gloo job, as torchrun starts one; every process stopped as soon as one fails."""
    port = free_port()
    procs = [subprocess.Popen(part_command(o, part, out, **more), env=environment(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world))) for r in range(world)]
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"the gloo job failed: exit codes {codes}")


def run_single(o, out):
    code = subprocess.call(part_command(o, "single", out), env=environment())
    if code:
        raise RuntimeError(f"the one-process part failed: exit code {code}")


def versions():
    import h5py
    import safetensors
    import torch
    import shardckpt
    out = {"torch": torch.__version__, "safetensors": safetensors.__version__, "h5py": h5py.__version__,
           "hdf5": h5py.version.hdf5_version, "shardckpt": shardckpt.__version__, "python": sys.version.split()[0]}
    try:
        import megatron.core
        out["megatron-core"] = megatron.core.__version__
    except ImportError:
        pass
    return out


def h5py_reads(path, config):
    """Every dataset of shardckpt's checkpoint read by h5py alone; the first block's raw bf16 bits
    equal the pattern."""
    import h5py
    import numpy as np
    import torch
    from peers import model
    spec = model.specs(config, 1)[0]
    section = spec.sections[0]
    key, shape = model.block_key(spec, section), model.block_shape(spec, section)
    with h5py.File(path, "r") as f:
        names = []
        f.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
        raw = np.empty(f[key].shape, np.uint16)
        f[key].id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=f[key].id.get_type())
    want = model.pattern(model.Piece(key, shape, (0,) * len(shape), shape, 0, 0))
    return len(names), torch.equal(torch.from_numpy(raw.view(np.int16)), want.view(torch.int16))


def run_phase(o, part, sides, alone):
    """A phase of gloo jobs: `sides` in interleaved rounds, then each of `alone` in a job of its own
    (one save and one load: the high-water mark of a process that ran only that side)."""
    out = {}
    for which, rounds in [(",".join(sides), None)] + [(side, 1) for side in alone]:
        name = part if rounds is None else f"{part}-{which}"
        path = os.path.join(o.dir, name + ".json")
        run_job(o, path, world=o.storage_ranks, part=part, sides=which, rounds=rounds)
        with open(path) as f:
            out[name] = json.load(f)
    return out


def run_storage(o):
    """DCP's FileSystem storage and shardckpt.dcp's (bench/peers/storage.py)."""
    return run_phase(o, "storage", ("fs", "shardckpt"), ("fs", "shardckpt"))


def run_megatron(o):
    """Megatron's torch_dist, alone and fully parallel, and the shardckpt backend (bench/peers/megatron.py)."""
    import importlib.util
    registry = importlib.util.find_spec("megatron.core.dist_checkpointing.strategies.base") is not None
    sides = ("torch_dist", "torch_dist_fp", "shardckpt") + (() if registry else ("torch_dist_async", "shardckpt_async"))
    return run_phase(o, "megatron", sides, ("torch_dist", "shardckpt"))


def run_mamba(o):
    """no_gather against Megatron's own gather of a GTP Mamba in_proj (bench/peers/mamba.py): one gloo
    job of --mamba-ranks processes, the sides in interleaved rounds."""
    path = os.path.join(o.dir, "mamba.json")
    run_job(o, path, world=o.mamba_ranks, part="mamba", sides="gather,no_gather")
    with open(path) as f:
        return json.load(f)


def report_of(o, job, one, storage, megatron=None, mamba=None):
    from peers import report, system
    r = report.Report()
    r.set("repeat", o.repeat)
    r.set("read_repeat", o.read_repeat)
    r.set("cache", system.cache_method())
    r.set("versions", versions())
    mismatches = []
    if job is not None:
        peers_report(o, r, job, one)
        mismatches += job["mismatches"] + one["mismatches"]
    if storage is not None:
        report.storage(r, storage)
        mismatches += [m for s in storage.values() for m in s["mismatches"]]
    if megatron is not None:
        report.megatron(r, megatron)
        mismatches += [m for s in megatron.values() for m in s["mismatches"]]
    if mamba is not None:
        report.mamba(r, mamba)
        mismatches += mamba["mismatches"]
    r.add("mismatches", len(mismatches), note="every load checked")
    r.set("first_mismatches", mismatches[:5])
    return r, bool(mismatches)


def peers_report(o, r, job, one):
    from peers import model, report
    config = model.bench_config(o.size_mib * MiB)
    nbytes = model.model_bytes(config)
    r.set("bytes", nbytes)
    r.set("model", {"gdp_layers": config.gdp_layers, "mamba_layers": config.mamba_layers, "cols": config.cols,
                    **model.DIMS, "dtype": "bf16", "tensors": len(model.specs(config, 1))})
    r.set("layouts", {"save": "TP 2 x GTP 4, alignment 32, 8 gloo processes",
                      "reshard": "TP 1 x GTP 8, alignment 16", "single": "TP 1 x GTP 1, one process"})
    r.set("peak_memory_method", job["peak_method"])
    r.set("dcp_sharded_tensor", "ShardedTensor._init_from_local_shards_and_global_metadata")
    report.distributed(r, job, nbytes)
    report.single(r, one, nbytes)
    datasets, equal = h5py_reads(os.path.join(o.dir, "shardckpt-save.h5"), config)
    r.add("shardckpt_h5py_datasets", datasets, target="h5py reads the checkpoint", met=datasets > 0 and equal)


def describe(o):
    from peers import model, storage
    if o.only in (None, "peers"):
        config = model.bench_config(o.size_mib * MiB)
        print(f"bench/peers.py: {model.model_bytes(config) / MiB:.1f} MiB ({config.gdp_layers} GDP + "
              f"{config.mamba_layers} Mamba layers, bf16), {o.repeat} write and {o.read_repeat} read rounds, "
              f"directory {o.dir}", file=sys.stderr)
    if o.only in ("storage", "megatron", None):
        shape = storage.shape_for(o.storage_mib * MiB)
        print(f"bench/peers.py: {o.only or 'storage'} phase: {storage.state_bytes(shape) / MiB:.1f} MiB ({shape[0]} layers of "
              f"hidden {shape[1]}, weights bf16, Adam f32) on {o.storage_ranks} gloo processes, {o.repeat} write and "
              f"{o.read_repeat} read rounds", file=sys.stderr)
    if o.only == "mamba":
        print(f"bench/peers.py: mamba phase: a MambaMixer's in_proj GTP-sharded over {o.mamba_ranks} gloo processes, "
              f"Megatron's gather against no_gather, {o.repeat} rounds", file=sys.stderr)


def main(argv):
    o = arguments(argv)
    sys.path.insert(0, HERE)
    if o.warm_cache:
        os.environ["PEERS_WARM_CACHE"] = "1"  # the parts inherit it
    if o.part == "storage":
        from peers import storage
        storage.main(o.storage_mib * MiB, o.dir, o.repeat, o.read_repeat, o.out, o.sides.split(","))
        return 0
    if o.part == "megatron":
        from peers import megatron
        megatron.main(o.storage_mib * MiB, o.dir, o.repeat, o.read_repeat, o.out, o.sides.split(","))
        return 0
    if o.part == "mamba":
        from peers import mamba
        mamba.main(o.dir, o.repeat, o.out, o.sides.split(","))
        return 0
    if o.part:
        from peers import jobs, single
        (jobs if o.part == "job" else single).main(o.size_mib * MiB, o.dir, o.repeat, o.read_repeat, o.out)
        return 0
    made = o.dir is None
    o.dir = o.dir or tempfile.mkdtemp(prefix="shardckpt-peers-")
    os.makedirs(o.dir, exist_ok=True)
    job_out, single_out = os.path.join(o.dir, "job.json"), os.path.join(o.dir, "single.json")
    try:
        if not o.json:
            describe(o)
        job = one = storage = megatron = mamba = None
        if o.only in (None, "peers"):
            run_job(o, job_out)
            run_single(o, single_out)
            with open(job_out) as f, open(single_out) as g:
                job, one = json.load(f), json.load(g)
        if o.only in (None, "storage"):
            storage = run_storage(o)
        if o.only == "megatron":
            megatron = run_megatron(o)
        if o.only == "mamba":
            mamba = run_mamba(o)
        r, mismatched = report_of(o, job, one, storage, megatron, mamba)
    finally:
        if not o.keep:
            clean(o.dir, made)
    print(r.to_json()) if o.json else r.print_table()
    return 1 if mismatched else 0


def clean(directory, made):
    from peers import system
    for name in OUTPUTS:
        system.remove(os.path.join(directory, name))
    if made:
        os.rmdir(directory)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as e:  # noqa: BLE001 - a benchmark reports its error and exits 2
        print(f"bench/peers.py: {e}", file=sys.stderr)
        sys.exit(2)
