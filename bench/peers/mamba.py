"""shardckpt.megatron.no_gather against Megatron's own gather, on a real megatron-core (0.19 or later)
MambaMixer whose in_proj.weight Megatron itself GTP-shards (initialize_model_parallel with
gtp_remat_size = the world: TP 1, GTP over every process), on CPU under gloo (bench/peers.py --only
mamba). The set-up is that of tests/megatron/mamba_worker.py: GTP switched on where megatron-core reads
it (it needs Transformer Engine otherwise), mamba_ssm's kernels declared present (they serve only the
forward, which never runs here), torch.cuda's calls that Megatron makes on CPU too made harmless.

The mixer: 192 heads of 160, 1 group of state 64, hidden 1,024: in_proj is [z | x | B | C | dt] =
[30,720 | 30,720 | 64 | 64 | 192] = 61,760 rows x 1,024 columns of bf16 TP-local (the seed's row
count), GTP-sharded with GTP_CONFIG.pad_for_alignment = 32 (the MXFP8 recipe's): at GTP 8 each rank
holds 7,744 rows, the last 7,552 real and 192 pad rows.

Sides, both under torch.no_grad() and saved by dist_checkpointing.save with the "shardckpt" backend's
SaveStrategy():
  - "gather": MambaMixer.sharded_state_dict as megatron-core has it: all_gather_into_tensor of the
    shard into the whole padded TP-local weight on every rank (gloo stages a second copy of it inside
    the collective; NCCL gathers in place), the pad rows sliced off, split into z, x, B, C and dt
    (views; replicated over the GTP group, written by its first rank);
  - "no_gather": the same mixer after shardckpt.megatron.no_gather(mixer): each rank's pieces are
    views of its own shard, nothing gathered.
Per side and round: "<side>_state_dict", sharded_state_dict() alone with its factories applied (as
dist_checkpointing.save applies them), and "<side>_save", sharded_state_dict() and
dist_checkpointing.save together; the bytes of the state dict's tensors that are not the model's
own memory (views of a parameter excluded); the peak resident memory each phase adds per rank
(system.PeakMeter). Interleaved rounds, the page cache dropped before each phase; rank 0 times every
phase from a barrier to a barrier. Afterwards rank 0 reads both checkpoints with h5py: the same
datasets, byte for byte, and in_proj's blocks hold the values the ranks put in their shards."""
import json
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")  # megatron-core's deprecations, once per process and rank
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Megatron calls these on CPU too (it has no CPU path of its own).
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.ssm import mamba_mixer  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl  # noqa: E402
from megatron.core.tensor_parallel import gtp_api  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

import shardckpt.megatron as scm  # noqa: E402

from . import storage, system  # noqa: E402

# GTP on where megatron-core 0.19 reads it, as Transformer Engine turns it on; mamba_ssm's kernels
# serve only the forward.
gtp_api.HAVE_GTP = True
mamba_mixer.HAVE_GTP = True
mamba_mixer.is_gtp_param = gtp_api.is_gtp_param
mamba_mixer.HAVE_MAMBA_SSM = True

SIDES = ("gather", "no_gather")
PREFIX = "decoder.layers.0.mixer."
KEY = PREFIX + "in_proj.weight"
NAMES = ("z", "x", "B", "C", "dt")
DIMS = dict(heads=192, head_dim=160, groups=1, state=64, hidden=1024)
ALIGN = 32  # GTP_CONFIG.pad_for_alignment (the MXFP8 recipe's)


def blocks(dims=DIMS):
    """The TP-local rows of z, x, B, C and dt (TP 1)."""
    d, gs = dims["heads"] * dims["head_dim"], dims["groups"] * dims["state"]
    return [d, d, gs, gs, dims["heads"]]


def rows_of(dims=DIMS):
    return sum(blocks(dims))


def pattern(rows, cols):
    """The TP-local in_proj's rows `rows` (a range): small integers, exact in bf16, from the global row
    and the column, so that a row saved in the wrong place is seen."""
    r = torch.arange(rows.start, rows.stop, dtype=torch.int32)[:, None]
    c = torch.arange(cols, dtype=torch.int32)[None, :]
    return ((r * 7 + c * 3) % 241 - 120).to(torch.bfloat16)


def build_mixer(dims, gtp):
    """parallel_state at TP 1 x GTP `gtp`, and a bf16 MambaMixer of `dims` on CPU built there, its
    in_proj GTP-sharded by Megatron (ColumnParallelLinear), the shard's real rows set to pattern() of
    their TP-local rows, its pad rows zero. Returns (mixer, GTP rank, real rows of the shard)."""
    gtp_impl.update_gtp_config(pad_for_alignment=ALIGN)
    parallel_state.destroy_model_parallel()
    gtp_impl.reset_gtp_state()
    parallel_state.initialize_model_parallel(1, gtp_remat_size=gtp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    gtp_rank = parallel_state.get_gtp_weight_remat_rank()
    cfg = TransformerConfig(num_layers=1, hidden_size=dims["hidden"], num_attention_heads=4,
                            use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
                            mamba_state_dim=dims["state"], mamba_head_dim=dims["head_dim"],
                            mamba_num_groups=dims["groups"], mamba_num_heads=dims["heads"],
                            tensor_model_parallel_size=1)
    mixer = mamba_mixer.MambaMixer(
        cfg, mamba_mixer.MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        d_model=dims["hidden"], rmsnorm=False, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    weight = mixer.in_proj.weight
    if not gtp_api.is_gtp_param(weight):
        raise RuntimeError(f"in_proj.weight is not GTP-sharded ({type(weight).__name__})")
    shard_rows, total = weight.shape[0], rows_of(dims)
    if shard_rows * gtp != total + weight.pad_length or shard_rows % ALIGN:
        raise RuntimeError(f"a shard of {shard_rows} rows at GTP {gtp}, pad {weight.pad_length}: not {total} rows "
                           f"aligned to {ALIGN}")
    real = max(0, min(total - gtp_rank * shard_rows, shard_rows))
    with torch.no_grad():
        weight.zero_()
        weight[:real].copy_(pattern(range(gtp_rank * shard_rows, gtp_rank * shard_rows + real), dims["hidden"]))
    return mixer, gtp_rank, real


def storages(sd):
    """{storage pointer: bytes} of the tensors of a sharded state dict's ShardedTensors, its factories
    applied (on a copy of the dict)."""
    copy, _ = extract_matching_values(sd, lambda x: True)
    apply_factories(copy)
    out = {}
    for v in nested_values(copy):
        if isinstance(v, ShardedTensor) and v.data is not None:
            s = v.data.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


class Job(system.Rounds):
    def __init__(self, directory, isolated):
        self.rank, self.world, self.dir = dist.get_rank(), dist.get_world_size(), directory
        self.mixer, self.gtp_rank, self.real = build_mixer(DIMS, self.world)
        self.weight = self.mixer.in_proj.weight
        self.model = {p.untyped_storage().data_ptr() for p in self.mixer.parameters()}
        scm.no_gather(self.mixer)  # an instance's method: the class's own stays Megatron's
        self.meter, self.records, self.mismatches = system.PeakMeter(), {}, []
        self.isolated = isolated
        self.extra_bytes = {}  # side: bytes of the state dict's tensors that are not the model's

    def path(self, side):
        return os.path.join(self.dir, f"mamba-{side}")

    def sharded(self, side):
        """The mixer's sharded state dict: Megatron's own method (it gathers), or no_gather's."""
        with torch.no_grad():  # gloo's all_gather refuses a tensor that requires grad
            if side == "gather":
                return mamba_mixer.MambaMixer.sharded_state_dict(self.mixer, prefix=PREFIX)
            return self.mixer.sharded_state_dict(prefix=PREFIX)

    def local_bytes(self):
        return sum(p.numel() * p.element_size() for p in self.mixer.parameters())

    def state_dict(self, side):
        sd = self.sharded(side)
        self.extra_bytes[side] = sum(n for ptr, n in storages(sd).items() if ptr not in self.model)

    def save(self, side):
        self.timed(f"mamba_{side}_state_dict", lambda: self.state_dict(side))

        def fn():
            sd = self.sharded(side)
            with torch.no_grad():
                dist_checkpointing.save(sd, self.path(side), sharded_strategy=scm.SaveStrategy())
        # Megatron saves into an existing directory.
        self.timed(f"mamba_{side}_save", fn, old=self.path(side), recreate=True)

    def load(self, side, timed=True):
        pass  # the checkpoints are compared by h5py (verify)

    def run(self, sides, rounds, read_rounds):
        return super().run(sides, rounds, 0, loads=[])


def raw(dataset):
    """A dataset's bytes as an array of unsigned integers of its element size (bf16 has no numpy type)."""
    import h5py
    import numpy as np
    size = dataset.id.get_type().get_size()
    out = np.empty(dataset.shape, {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
    dataset.id.read(h5py.h5s.ALL, h5py.h5s.ALL, out, mtype=dataset.id.get_type())
    return out


def verify(job):
    """Rank 0: both checkpoints hold the same datasets, byte for byte, and in_proj's blocks the
    pattern. Returns (mismatches, number of datasets)."""
    import h5py
    import numpy as np
    files = {side: h5py.File(os.path.join(job.path(side), scm.FILE_NAME), "r") for side in SIDES}
    bad = []
    try:
        names = {}
        for side, f in files.items():
            names[side] = []
            f.visititems(lambda n, obj, side=side: names[side].append(n) if isinstance(obj, h5py.Dataset) else None)
        if set(names["gather"]) != set(names["no_gather"]):
            bad.append(f"mamba datasets differ: {sorted(set(names['gather']) ^ set(names['no_gather']))[:5]}")
        tensors = [n for n in names["gather"] if n in names["no_gather"] and n.startswith(PREFIX)]
        for n in tensors:
            a, b = files["gather"][n], files["no_gather"][n]
            if a.shape != b.shape or a.id.get_type().get_size() != b.id.get_type().get_size() or \
                    not np.array_equal(raw(a), raw(b)):
                bad.append(f"mamba {n}: the gather's and no_gather's checkpoints differ")
        start = 0
        for name, rows in zip(NAMES, blocks()):
            want = pattern(range(start, start + rows), DIMS["hidden"]).view(torch.int16).numpy().view(np.uint16)
            for side, f in files.items():
                d = f.get(f"{KEY}.{name}")
                if d is None or not np.array_equal(raw(d), want):
                    bad.append(f"mamba {side}: {KEY}.{name} does not hold the shards' rows")
            start += rows
    finally:
        for f in files.values():
            f.close()
    return bad, len(tensors)


def main(directory, rounds, out_path, sides=SIDES):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        job = Job(directory, isolated=False)
        everyone = job.run(tuple(sides), rounds, 0)
        extra = [None] * job.world
        dist.all_gather_object(extra, job.extra_bytes)
        if job.rank == 0:
            out = storage.merge(everyone, job, sides)
            bad, datasets = verify(job) if set(sides) == set(SIDES) else ([], 0)
            out["mismatches"] += bad
            shard_rows = job.weight.shape[0]
            out |= {"dims": DIMS, "rows": rows_of(), "cols": DIMS["hidden"], "blocks": dict(zip(NAMES, blocks())),
                    "gtp": job.world, "tp": 1, "align": ALIGN, "shard_rows": shard_rows,
                    "pad_rows": shard_rows * job.world - rows_of(),
                    "in_proj_bytes": rows_of() * DIMS["hidden"] * 2,
                    "shard_bytes": shard_rows * DIMS["hidden"] * 2,
                    "state_dict_extra_bytes": {s: max(e[s] for e in extra) for s in sides},
                    "datasets_compared": datasets,
                    "megatron_core": __import__("megatron.core").core.__version__}
            with open(out_path, "w") as f:
                json.dump(out, f)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # the other ranks are stopped by the launcher
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
