"""torch.distributed.checkpoint (torch 2.x) with shardckpt as its storage: a tensor-parallel model
(DTensor parameters) and its Adam saved by dcp.save into ONE HDF5 file, read by h5py at global
shapes, and resumed by dcp.load. Run on N processes as torchrun starts them:
    torchrun --nproc-per-node 4 dcp_storage.py DIR
Prints "dcp: saved DIR/step2.h5, 0.weight (16, 8) in h5py, resumed" on rank 0."""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardckpt.dcp import Reader, Writer


def make(mesh, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def step(model, opt, i):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, opt = make(mesh, seed=0)
    for i in range(2):
        step(model, opt, i)
    path = os.path.join(out, "step2.h5")

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=Writer(path))

    if dist.get_rank() == 0:
        import h5py
        with h5py.File(path, "r") as f:
            shape = f["model.0.weight"].shape  # the global shape, whatever the TP degree

    model2, opt2 = make(mesh, seed=1)
    model_sd, optim_sd = get_state_dict(model2, opt2)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=Reader(path))
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])

    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        if not torch.equal(a.full_tensor(), b.full_tensor()):
            raise SystemExit(f"{k} differs after the resume")
    if dist.get_rank() == 0:
        print(f"dcp: saved {path}, 0.weight {shape} in h5py, resumed")
    dist.barrier()  # every rank done with the group before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
