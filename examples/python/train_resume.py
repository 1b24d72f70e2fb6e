#!/usr/bin/python3
"""A PyTorch training run that is killed and resumes (docs/python.md).

A small model with a GatedDeltaProduct-style fused in_proj and a Mamba-style one, GTP-sharded over
4 gloo processes (TP 2 x GTP 2, alignment 16): bf16 weights, an f32 master copy and f32 Adam
state, trained with torch.optim.Adam on seeded synthetic data, saved with shardckpt in the
background every few steps (weights, Adam state, step).

    train_resume.py OUT            runs the whole story, in OUT:
      A  the uninterrupted run                                     (4 processes)
      B  the same run, SIGKILLed mid-run by this script            (4 processes)
      C  B resumed from its last committed checkpoint, same layout: its losses equal A's bit for bit
      D  B's checkpoint loaded at TP 1 x GTP 3: weights and Adam state equal what B saved, bit for bit
      and the loss curve, OUT/loss.png

    train_resume.py --rank-main MODE OUT ...   one process of a job (what the story starts)
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

STEPS, SAVE_EVERY, KILL_AT = 40, 5, 23
TP, GTP, ALIGN = 2, 2, 16
COLS, BATCH = 32, 16


# ---- one process of a job ----------------------------------------------------------------------------

def model_specs(sc, tp):
    gdp = sc.SsmDims(heads=4, head_dim=8, groups=2, state=8, householder=2)
    mamba = sc.SsmDims(heads=4, head_dim=8, groups=2, state=8)
    return [sc.ParamSpec("layers.0.gdp.in_proj.weight", sc.gdp_in_proj_sections(gdp, tp), [COLS], tp=tp,
                         divisors=sc.ssm_divisors(gdp)),
            sc.ParamSpec("layers.1.mamba.in_proj.weight", sc.mamba_in_proj_sections(mamba, tp), [COLS], tp=tp,
                         divisors=sc.ssm_divisors(mamba))]


class Rank:
    """This rank's shards: bf16 weights, the f32 master copy Adam updates, and Adam's state."""

    def __init__(self, sc, torch, dist, tp, gtp, align):
        self.sc, self.torch, self.dist = sc, torch, dist
        rank = dist.get_rank()
        self.tp_rank, self.gtp_rank = rank // gtp, rank % gtp
        # Every process makes every group, in the same order (torch.distributed's rule).
        self.gtp_group = [dist.new_group([t * gtp + g for g in range(gtp)]) for t in range(tp)][self.tp_rank]
        self.tp_group = [dist.new_group([t * gtp + g for t in range(tp)]) for g in range(gtp)][self.gtp_rank]
        self.params = [sc.ShardedParam(s, gtp=gtp, align=align, tp_rank=self.tp_rank, gtp_rank=self.gtp_rank,
                                       dtype=torch.bfloat16) for s in model_specs(sc, tp)]
        self.weights, self.masters = [], []
        for p in self.params:
            g = torch.Generator().manual_seed(1000 + p.spec.rows() + self.tp_rank)
            full = torch.randn(p.spec.rows(), COLS, generator=g) * 0.1  # this TP rank's whole weight
            master = torch.zeros(p.padded_shape())
            lo = p.gtp_rank * p.padded_shape()[0]
            master[:p.real_rows()] = full[lo:lo + p.real_rows()]
            self.masters.append(master)
            self.weights.append(master.to(torch.bfloat16))
        self.opt = torch.optim.Adam(self.masters, lr=1e-2)
        for m in self.masters:  # Adam's state exists from the start, so that a load can fill it
            self.opt.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                 "exp_avg_sq": torch.zeros_like(m)}

    def state_dict(self, step):
        sc, torch = self.sc, self.torch
        state = sc.StateDict()
        for p, w, m in zip(self.params, self.weights, self.masters):
            p.shard = w
            state.add(p)
            state.add(p.optimizer_state("fp32_param", shard=m))
            state.add(p.optimizer_state("exp_avg", shard=self.opt.state[m]["exp_avg"]))
            state.add(p.optimizer_state("exp_avg_sq", shard=self.opt.state[m]["exp_avg_sq"]))
        if step is not None:
            state.add_common("step", step)
        return state

    def gathered(self, shard, rows):
        """This TP rank's weight: the GTP group's shards side by side (bf16 moved as bytes: torch
        1.13's gloo refuses bf16)."""
        torch, dist = self.torch, self.dist
        parts = [torch.empty_like(shard.view(torch.uint8)) for _ in range(GTP)]
        dist.all_gather(parts, shard.view(torch.uint8), group=self.gtp_group)
        return torch.cat(parts).view(torch.bfloat16)[:rows]

    def train_step(self, step, before_update=None):
        torch, dist = self.torch, self.dist
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, COLS, generator=g)
        loss = torch.zeros(())
        self.opt.zero_grad(set_to_none=False)
        for p, w, m in zip(self.params, self.weights, self.masters):
            rows = p.spec.rows()
            local = self.gathered(w, rows).float().requires_grad_()
            t = torch.Generator().manual_seed(10_000 * step + 17 * self.tp_rank + rows)
            target = torch.randn(BATCH, rows, generator=t)
            part = ((x @ local.t() - target) ** 2).mean()
            part.backward()
            lo = p.gtp_rank * p.padded_shape()[0]
            grad = torch.zeros_like(m)
            grad[:p.real_rows()] = local.grad[lo:lo + p.real_rows()]
            m.grad = grad
            loss = loss + part.detach()
        if before_update is not None:
            before_update()  # a save in flight must have read the weights before they change
        self.opt.step()
        for w, m in zip(self.weights, self.masters):
            w.copy_(m.to(torch.bfloat16))
        dist.all_reduce(loss, group=self.tp_group)
        return float(loss)


def rank_main(mode, out, args):
    import torch
    import torch.distributed as dist
    import shardckpt as sc
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    tp, gtp, align = (1, 3, 8) if mode == "check" else (TP, GTP, ALIGN)
    me = Rank(sc, torch, dist, tp, gtp, align)
    group = sc.TorchGroup()
    rank = dist.get_rank()
    if mode == "check":  # D: B's checkpoint at TP 1 x GTP 3, against what B's ranks saved
        state = me.state_dict(None)
        step = sc.load_into(os.path.join(args[0], "ckpt.h5"), state, group)["step"]
        expected = expected_shards(sc, torch, args[0], step, me)
        for key, tensor in loaded_shards(me).items():
            assert torch.equal(tensor, expected[key]), f"{key} differs on rank {rank}"
        print(f"rank {rank}: step {step}: {len(expected)} shards equal what was saved, bit for bit")
        dist.barrier()
        return
    first = 1
    if mode == "resume":
        saved = sc.load_into(os.path.join(args[0], "ckpt.h5"), me.state_dict(None), group)["step"]
        for m in me.masters:  # Adam counts its steps (bias correction): one per training step
            me.opt.state[m]["step"] = torch.tensor(float(saved))
        first = saved + 1
    saver = sc.Saver(group)
    pending, losses, delay = None, {}, float(os.environ.get("STEP_DELAY", "0"))
    for step in range(first, STEPS + 1):
        losses[step] = me.train_step(step, pending.wait_staged if pending is not None else None).hex()
        if rank == 0:
            with open(os.path.join(out, "progress"), "w") as f:
                f.write(str(step))
        if step % SAVE_EVERY == 0:
            if pending is not None:
                pending.wait()  # one save in flight
            if mode == "run":  # what this rank saved, for D to compare with
                torch.save(loaded_shards(me), os.path.join(out, f"saved-{step}-rank{rank}.pt"))
            pending = saver.save_async(me.state_dict(step), os.path.join(out, "ckpt.h5"))
        time.sleep(delay)
    if pending is not None:
        pending.wait()
    if rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    dist.barrier()


def loaded_shards(me):
    out = {}
    for p, w, m in zip(me.params, me.weights, me.masters):
        out[p.key] = w.clone()
        out["fp32_param." + p.key] = m.clone()
        out["exp_avg." + p.key] = me.opt.state[m]["exp_avg"].clone()
        out["exp_avg_sq." + p.key] = me.opt.state[m]["exp_avg_sq"].clone()
    return out


def expected_shards(sc, torch, run_dir, step, me):
    """What rank `me` (TP 1) holds of what B's TP 2 x GTP 2 ranks saved at `step`: each TP rank's
    weight is its GTP shards' real rows in order; the TP 1 weight is, block by block, the TP ranks'
    rows of that block in TP order (the fused-layout rule); then this rank's padded GTP shard."""
    saved = [torch.load(os.path.join(run_dir, f"saved-{step}-rank{r}.pt")) for r in range(TP * GTP)]
    out = {}
    for p in me.params:
        at_tp = model_specs(sc, TP)[[s.key for s in model_specs(sc, TP)].index(p.key)]
        for prefix in ["", "fp32_param.", "exp_avg.", "exp_avg_sq."]:
            local = []
            for t in range(TP):
                shards = [saved[t * GTP + g][prefix + p.key] for g in range(GTP)]
                local.append(torch.cat(shards)[:at_tp.rows()])
            blocks, start = [], 0
            for s in at_tp.sections:
                blocks += [local[t][start:start + s.rows] for t in range(TP)]
                start += s.rows
            full = torch.cat(blocks)
            shard = torch.zeros(p.padded_shape(), dtype=full.dtype)
            lo = p.gtp_rank * p.padded_shape()[0]
            shard[:p.real_rows()] = full[lo:lo + p.real_rows()]
            out[prefix + p.key] = shard
    return out


# ---- the story -------------------------------------------------------------------------------------------

def job(world, mode, out, *args, delay=0.0, kill_at=None):
    """Runs a job of `world` processes (as torchrun would start them); with `kill_at`, SIGKILLs them
    all once rank 0 reports that step. Returns whether it was killed."""
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1", STEP_DELAY=str(delay))
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", mode, out, *args], env=env))
    progress = os.path.join(out, "progress")
    while kill_at is not None and all(p.poll() is None for p in procs):
        try:
            with open(progress) as f:
                if int(f.read() or 0) >= kill_at:
                    break
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    if kill_at is not None:
        for p in procs:
            p.send_signal(signal.SIGKILL)
    codes = [p.wait(timeout=300) for p in procs]
    if kill_at is None and any(codes):
        sys.exit(f"{mode} job failed: exit codes {codes}")
    return kill_at is not None


def plot(out, a, c, resumed_from):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    steps = sorted(a)
    ax.plot(steps, [a[s] for s in steps], label="A: uninterrupted", color="#1f77b4")
    ax.plot(sorted(c), [c[s] for s in sorted(c)], "o", markersize=4, mfc="none", color="#d62728",
            label=f"C: killed at step {KILL_AT}, resumed from step {resumed_from}")
    ax.axvline(resumed_from, color="gray", linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("TP 2 x GTP 2 (alignment 16), bf16 weights, f32 Adam, async saves every 5 steps", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"))


def story(out):
    import shardckpt as sc
    run_a, run_b, run_c = (os.path.join(out, d) for d in ("A", "B", "C"))
    for d in ("A", "B", "C", "D"):  # a story starts from nothing
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    job(4, "run", run_a)
    job(4, "run", run_b, delay=0.05, kill_at=KILL_AT)
    step = sc.inspect(os.path.join(run_b, "ckpt.h5"))["common"]["step"]
    sc.verify(os.path.join(run_b, "ckpt.h5"))
    assert SAVE_EVERY <= step <= KILL_AT, step
    job(4, "resume", run_c, run_b)
    with open(os.path.join(run_a, "losses.json")) as f:
        a = {int(k): v for k, v in json.load(f).items()}
    with open(os.path.join(run_c, "losses.json")) as f:
        c = {int(k): v for k, v in json.load(f).items()}
    assert sorted(c) == list(range(step + 1, STEPS + 1)), sorted(c)
    differ = [s for s in c if c[s] != a[s]]
    assert not differ, f"losses after the resume differ from the uninterrupted run's at steps {differ}"
    print(f"C: killed at step {KILL_AT}, resumed from step {step}: losses of steps {step + 1}..{STEPS} "
          "equal the uninterrupted run's, bit for bit")
    job(3, "check", os.path.join(out, "D"), run_b)
    plot(out, {s: float.fromhex(v) for s, v in a.items()}, {s: float.fromhex(v) for s, v in c.items()}, step)
    print(f"loss curve: {os.path.join(out, 'loss.png')}")


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif len(sys.argv) == 2:
        story(sys.argv[1])
    else:
        sys.exit(__doc__)
