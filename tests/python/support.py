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


def run_cases(cases, directory, rank, *args):
    """A gloo job's worker loop: runs each case named on the command line (sys.argv[2:]) as
    cases[name](directory, *args) and writes "ok" or the failure's traceback to
    DIRECTORY/<case>.<rank>.json, a barrier after each so that one failing case does not stop the others."""
    import json
    import traceback
    import torch.distributed as dist
    for name in sys.argv[2:]:
        try:
            cases[name](directory, *args)
            result = "ok"
        except BaseException:  # the test reports any failure with its traceback
            result = traceback.format_exc()
        with open(os.path.join(directory, f"{name}.{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()


class GlooJobCase:
    """A unittest.TestCase mixin: WORLD processes of WORKER run CASES once for the class; check(case)
    asserts that every rank wrote "ok" for it and that every rank exited 0."""

    WORLD, WORKER, CASES = 4, None, []

    @classmethod
    def setUpClass(cls):
        import tempfile
        cls.tmp = tempfile.TemporaryDirectory()
        cls.results = run_ranks(cls.WORLD, cls.WORKER, cls.tmp.name, *cls.CASES, timeout=600)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def check(self, case):
        import json
        for rank, (code, out) in enumerate(self.results):
            path = os.path.join(self.tmp.name, f"{case}.{rank}.json")
            if not os.path.exists(path):
                self.fail(f"rank {rank} never finished case {case} (exit {code}):\n{out[-4000:]}")
            with open(path) as f:
                result = json.load(f)
            self.assertEqual(result, "ok", f"rank {rank}, case {case}:\n{result}")
        for rank, (code, out) in enumerate(self.results):
            self.assertEqual(code, 0, f"rank {rank} exited {code}:\n{out[-4000:]}")


def check_example(test, name, expect, world=4):
    """Runs examples/python/NAME on `world` gloo processes as torchrun would, with a new directory as
    its argument: every process exits 0 (no signal at exit) and rank 0 prints `expect`."""
    import tempfile
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", name)
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(world, script, d, timeout=300)
        for rank, (rc, text) in enumerate(results):
            test.assertEqual(rc, 0, f"rank {rank}:\n{text}")
        test.assertIn(expect, results[0][1])


def record_library_tensors(case):
    """The tensors the adapter hands the library as load and save entries, for the rest of `case`'s
    test (the adapter's _core wrapped, so that where each tensor lies can be checked)."""
    from unittest import mock
    from shardckpt import _adapter
    real, given = _adapter._core, []

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def ShardedTensor(key, tensor, *rest):
            given.append(tensor)
            return real.ShardedTensor(key, tensor, *rest)

    patch = mock.patch.object(_adapter, "_core", Recording())
    patch.start()
    case.addCleanup(patch.stop)
    return given


def copy_back_case(device):
    """(saved, targets) of the copy-back tests: a state, and targets for it on `device` that a load fills
    in place (contiguous ones of the stored dtype: a matrix, bool through its uint8 view, a 0-d
    tensor) or through temporaries (a transposed matrix, a tensor of another dtype)."""
    import torch
    saved = {"w": torch.arange(12.0).reshape(3, 4), "t": torch.arange(12.0).reshape(4, 3) + 50,
             "wide": torch.arange(5.0) - 2, "mask": torch.tensor([False, True, True]), "step": torch.tensor(9)}
    target = {"w": torch.zeros(3, 4, device=device), "t": torch.zeros(3, 4, device=device).t(),
              "wide": torch.zeros(5, dtype=torch.float64, device=device),
              "mask": torch.zeros(3, dtype=torch.bool, device=device), "step": torch.tensor(0, device=device)}
    return saved, target


def check_copy_back(case, saved, target, given):
    """A load of copy_back_case's `saved` into its `target`: every target holds what was saved, and the
    library was handed (`given`: record_library_tensors) the contiguous targets themselves and
    temporaries for the others."""
    import torch
    ptrs = {t.data_ptr() for t in given}
    for k in ("w", "mask", "step"):  # contiguous in the stored dtype (bool: its uint8 view): in place
        case.assertIn(target[k].data_ptr(), ptrs, k)
    for k in ("t", "wide"):  # through a temporary of the stored dtype
        case.assertNotIn(target[k].data_ptr(), ptrs, k)
    for k, v in saved.items():
        case.assertTrue(torch.equal(target[k].cpu(), v.to(target[k].dtype)), k)
