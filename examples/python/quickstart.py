#!/usr/bin/python3
"""From a torch model's GTP shards to a checkpoint and back (docs/python.md), under torchrun:

    torchrun --standalone --nproc_per_node 4 examples/python/quickstart.py OUT_DIR

Each of the 4 processes holds, at TP 2 x GTP 2 with alignment 16, the padded shard of a fused
GatedDeltaProduct in_proj (bf16) and its Adam moment (f32); they save one checkpoint together, in the
background, then load it back at another layout, and read it with h5py alone.
"""
import json
import os
import sys

import h5py
import numpy as np
import torch
import torch.distributed as dist

import shardckpt as sc

dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
tp, gtp = 2, 2
path = os.path.join(out, "quickstart.h5")

# The fused in_proj of a GDP layer at TP 2: its sections (z, V0, V1, K0, K1, Q, b0, b1, a) are the
# TP-local rows of each block, in row order.
dims = sc.SsmDims(heads=8, head_dim=4, groups=4, state=4, householder=2)
spec = sc.ParamSpec("layers.0.mixer.in_proj.weight", sc.gdp_in_proj_sections(dims, tp), [32], tp=tp,
                    divisors=sc.ssm_divisors(dims))  # recorded: a load at a TP that splits a head is refused
param = sc.ShardedParam(spec, gtp=gtp, align=16, tp_rank=rank // gtp, gtp_rank=rank % gtp, dtype=torch.bfloat16)
weight = torch.zeros(param.padded_shape(), dtype=torch.bfloat16)  # pad rows stay zero
weight[:param.real_rows()] = rank + 1
param.shard = weight  # the state dict refers to this tensor: no copy
exp_avg = param.optimizer_state("exp_avg", shard=torch.full(param.padded_shape(), 0.5))

state = sc.StateDict()
state.add(param)
state.add(exp_avg)
state.add_common("step", 100)

group = sc.TorchGroup()  # torch.distributed's default group
saver = sc.Saver(group)
pending = saver.save_async(state, path)  # returns at once, or once staged when they fit its budget
pending.wait_staged()  # the save has read this rank's rows: training may change the shards now
weight.fill_(0)
pending.wait()  # the collective outcome: every rank gets the same one

# Back at TP 1 x GTP 4 with alignment 8: each rank asks for its own shard and gets it in place.
spec1 = sc.ParamSpec(spec.key, sc.gdp_in_proj_sections(dims, 1), [32], divisors=sc.ssm_divisors(dims))
again = sc.ShardedParam(spec1, gtp=4, align=8, tp_rank=0, gtp_rank=rank, dtype=torch.bfloat16)
again.shard = torch.empty(again.padded_shape(), dtype=torch.bfloat16)  # filled in place, pad rows zeroed
request = sc.StateDict()
request.add(again)
values = sc.load_into(path, request, group)
assert values["step"] == 100

if rank == 0:
    # The TP-local weight of TP rank 1, its fused blocks joined in row order, as torch tensors.
    local = sc.read(path, tp=2, tp_rank=1)["layers.0.mixer.in_proj.weight"]
    assert local.dtype == torch.bfloat16 and local.shape == (spec.rows(), 32)
    # h5py alone: a block's raw bf16 bits, viewed as torch.bfloat16 (no conversion, full speed).
    with h5py.File(path, "r") as f:
        z = f["layers.0.mixer.in_proj.weight.z"]
        raw = np.empty(z.shape, np.uint16)
        z.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=z.id.get_type())
        z_bf16 = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    z_rows = spec.sections[0].rows  # TP rank 1's z rows are the second half of the z block
    assert torch.equal(z_bf16[z_rows:2 * z_rows], local[:z_rows])
    # h5py alone, the blocks in row order (h5py lists datasets alphabetically): the weight without TP.
    with h5py.File(path, "r") as f:
        records = json.loads(f["_shardckpt"].attrs["params"])  # each parameter's blocks, in row order
        blocks = next(r for r in records if r["key"] == spec.key)["blocks"]
        names = [f"{spec.key}.{b['name']}" if b["name"] else spec.key for b in blocks]
        fused = np.concatenate([f[name][()] for name in names])  # h5py reads bf16 as float32
    assert torch.equal(torch.from_numpy(fused).to(torch.bfloat16), sc.read(path)[spec.key])
    assert sc.read(path)["step"] == 100  # read gives the common values too
    print(f"saved at TP {tp} x GTP {gtp}, loaded at TP 1 x GTP 4: step {values['step']}, "
          f"z block {tuple(z_bf16.shape)} read with h5py")
dist.destroy_process_group()
