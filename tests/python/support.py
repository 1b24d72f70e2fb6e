"""What the Python tests share: a model's fused layouts, its full reference weights, and running a
function on N gloo processes as torchrun would (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
import os
import socket
import subprocess
import sys

import torch

import shardckpt as sc

DIMS = sc.SsmDims(heads=8, head_dim=4, groups=4, state=4, householder=2)
COLS = 8


def spec_at(tp, kind="gdp"):
    sections = {"gdp": sc.gdp_in_proj_sections, "mamba": sc.mamba_in_proj_sections}[kind](DIMS, tp)
    return sc.ParamSpec(f"decoder.layers.0.mixer.{kind}.in_proj.weight", sections, [COLS], tp=tp,
                        divisors=sc.ssm_divisors(DIMS))


def reference(tp, tp_rank, kind="gdp", dtype=torch.bfloat16):
    """The TP-local weight of TP rank `tp_rank` at TP `tp`: each global block's value is its global row
    index * 1000 + column + a block number, so a row in the wrong place is seen."""
    spec1 = spec_at(1, kind)
    local = spec_at(tp, kind)
    rows = []
    for b, (glob, loc) in enumerate(zip(spec1.sections, local.sections)):
        start = tp_rank * loc.rows
        r = torch.arange(start, start + loc.rows, dtype=torch.float64)[:, None] * 16 + \
            torch.arange(COLS, dtype=torch.float64)[None, :] + b * 4096
        rows.append(r)
    return torch.cat(rows).to(dtype)


def shard_of(weight, param):
    """The padded shard of `param` cut from its TP-local `weight` (pad rows zero)."""
    shape = param.padded_shape()
    out = torch.zeros(shape, dtype=weight.dtype)
    start = shape[0] * param.gtp_rank
    real = param.real_rows()
    out[:real] = weight[start:start + real]
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world, script, *args):
    """Starts `script` on `world` processes of one gloo job; returns the processes."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, script, *map(str, args)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def finish_ranks(procs, timeout=240):
    """The (returncode, output) of each process start_ranks started (killed after `timeout` s)."""
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(timed out)"
        results.append((p.returncode, out))
    return results


def run_ranks(world, script, *args, timeout=240):
    """Runs `script` on `world` processes of one gloo job; returns their (returncode, output)."""
    return finish_ranks(start_ranks(world, script, *args), timeout)


def h5py_bf16(dataset):
    """A bf16 dataset read with h5py as its raw bits (no conversion), viewed as torch.bfloat16."""
    import h5py
    import numpy as np
    raw = np.empty(dataset.shape, np.uint16)
    dataset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=dataset.id.get_type())
    return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
