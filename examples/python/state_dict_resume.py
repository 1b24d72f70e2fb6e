"""A plain torch training run saved and resumed through its state dicts, in two lines each:
shardckpt.save_state_dict and shardckpt.load_state_dict. Runs alone (python state_dict_resume.py DIR)
or on N processes started as torchrun starts them (every rank holds the same replicated model, as
with DDP: each writes a share of every tensor's rows).
Prints "resumed at step 3: the next 2 steps match" on rank 0."""
import os
import sys

import torch
import torch.distributed as dist

import shardckpt


def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def step(model, opt, i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(32, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main():
    out = sys.argv[1]
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    model, opt = make(seed=0)
    for i in range(3):
        step(model, opt, i)
    path = os.path.join(out, "step3.h5")

    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    shardckpt.save_state_dict(state, path)

    # A new process would build its model and optimizer, then load: the model's tensors are filled
    # in place; the optimizer's state (which a new Adam does not have yet) comes back in the result.
    model2, opt2 = make(seed=1)
    loaded = shardckpt.load_state_dict({"model": model2.state_dict(), "optim": opt2.state_dict()}, path)
    opt2.load_state_dict(loaded["optim"])
    start = loaded["step"]

    ahead = [step(model, opt, i) for i in range(start, start + 2)]
    resumed = [step(model2, opt2, i) for i in range(start, start + 2)]
    if ahead != resumed:
        raise SystemExit(f"resumed losses {resumed} differ from {ahead}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"resumed at step {start}: the next 2 steps match")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
