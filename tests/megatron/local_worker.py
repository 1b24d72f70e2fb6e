"""One process of a gloo job under megatron-core 0.19 with nvidia-resiliency-ext
(tests/megatron/test_local.py): GTP shards through Megatron's local (non-persistent) checkpoints,
MCoreTensorAwareStateDict.from_state_dict -> nvrx's LocalCheckpointManager save and load (a real file
per rank in DIR) -> to_state_dict, with algo "atomic" and "fully_parallel" over the 4 ranks. Runs every
case named on the command line and writes, for each, "ok" or the failure's traceback to
DIR/<case>.<rank>.json.

The seed geometry (61,760 rows, GTP 64, alignment 32: shards of 992 rows, GTP rank 62 holds 256 real
rows, 63 none) cannot run 64 processes: each of the 4 ranks plays one of its GTP ranks (the pieces,
the placeholder and the merge are per-rank computations; what crosses ranks is Megatron's
fully_parallel exchange, which sees the 4 ranks as the data-parallel group), two ranks playing the
same GTP rank as data-parallel replicas, with C = 8 columns."""
import os
import shutil
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Megatron calls these on CPU too (it has no CPU path of its own).
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor  # noqa: E402


def _on_cpu(device):
    return "cpu" if device is not None and str(device).startswith("cuda") else device


# fully_parallel's load exchange (exchange_algo "broadcast", Megatron's default) stages every tensor on
# "cuda": on this CPU-only machine those tensors stay on the CPU (gloo broadcasts them).
_init_data, _empty_like = ShardedTensor.init_data, torch.empty_like
ShardedTensor.init_data = lambda self, device, init_fn=torch.empty: _init_data(self, _on_cpu(device), init_fn)
torch.empty_like = lambda t, *a, device=None, **k: _empty_like(t, *a, device=_on_cpu(device), **k)
torch.Tensor.cuda = lambda self, *a, **k: self

from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor  # noqa: E402
from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict  # noqa: E402
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import shardckpt as sc  # noqa: E402
from shardckpt._local import gtp_shard_factory, to_state_dict  # noqa: E402
from shardckpt._no_gather import no_gather  # noqa: E402
from support import run_cases  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
PREFIX = "decoder.layers.0.mixer."
C = 8
# The seed geometry as a Mamba in_proj: z, x (28,672 rows each), B, C (1,984), dt (448): 61,760 rows.
SECTIONS = [("z", 28672), ("x", 28672), ("B", 1984), ("C", 1984), ("dt", 448)]
SPEC = sc.ParamSpec("in_proj.weight", [sc.Section(n, r) for n, r in SECTIONS], [C])
KEY = PREFIX + SPEC.key
GTP, ALIGN, SHARD_ROWS = 64, 32, 992
REAL = {0: 992, 62: 256, 63: 0}
# (GTP rank, data-parallel replica) each rank plays: real and padding-only shards, each with a replica
# on another rank, so that fully_parallel saves one of them and hands it to the other on load.
LAYOUTS = {"mixed": [(0, 0), (62, 0), (63, 0), (62, 1)], "tail": [(62, 0), (63, 0), (62, 1), (63, 1)]}
COMMON = {"iteration": 7, "args": {"lr": 0.5, "name": "seed", "dims": [61760, 64, 32], "flag": None}}


def value(gtp_rank, rows, base):
    """Real rows `rows` of GTP rank `gtp_rank`'s shard (or an optimizer state, by `base`): small integers,
    exact in bf16, from the global row and column, so that a row in the wrong place is seen."""
    r = torch.arange(gtp_rank * SHARD_ROWS, gtp_rank * SHARD_ROWS + rows, dtype=torch.float64)[:, None]
    c = torch.arange(C, dtype=torch.float64)[None, :]
    return (r * 7 + c * 3 + base) % 120 + 1  # 1..120, never 0: a zeroed real row is seen


def expected(gtp_rank, dtype, base=0):
    out = torch.zeros(SHARD_ROWS, C, dtype=dtype)
    out[:REAL[gtp_rank]] = value(gtp_rank, REAL[gtp_rank], base).to(dtype)
    return out


class Rank:
    """The GTP rank this process plays, its shard (the weight) and an optimizer state of it, in `dtype`,
    and a state dict of them with plain values beside."""

    def __init__(self, layout, dtype, fill=None):
        self.gtp_rank, self.replica = LAYOUTS[layout][RANK]
        self.dtype = dtype
        self.param = sc.ShardedParam(SPEC, gtp=GTP, align=ALIGN, tp_rank=0, gtp_rank=self.gtp_rank,
                                     replica_id=self.replica)
        if tuple(self.param.padded_shape()) != (SHARD_ROWS, C) or self.param.real_rows() != REAL[self.gtp_rank]:
            raise AssertionError(f"not the seed geometry: {self.param.padded_shape()}, {self.param.real_rows()} real")
        if fill is None:
            self.weight, self.exp_avg = expected(self.gtp_rank, dtype), expected(self.gtp_rank, dtype, base=50)
        else:  # a load's request: every row (pad rows too) set to `fill`
            self.weight, self.exp_avg = torch.full((SHARD_ROWS, C), fill, dtype=dtype), torch.full((SHARD_ROWS, C), fill,
                                                                                                  dtype=dtype)
        self.param.shard = self.weight
        self.norm = torch.arange(C, dtype=dtype) + (0 if fill is None else 100)  # the same on every rank
        self.step = torch.tensor(3 if fill is None else 0)

    def state_dict(self):
        factory = gtp_shard_factory(self.param, PREFIX)
        norm = ShardedTensor.from_rank_offsets(PREFIX + "norm.weight", self.norm, replica_id=RANK)
        return {"model": {KEY: factory, PREFIX + "norm.weight": norm},
                "optimizer": {"exp_avg": make_sharded_optimizer_tensor(factory, self.exp_avg, "optimizer.state.exp_avg"),
                              "step": self.step},
                "rng": LocalNonpersistentObject("this rank's"), **COMMON}


def group():
    return dist.group.WORLD


def save_local(directory, sd, algo):
    """from_state_dict and nvrx's LocalCheckpointManager.save (iteration 1) under `directory`; returns
    the path of this rank's file."""
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sd, algo=algo, parallelization_group=group())
    manager = LocalCheckpointManager(directory)
    manager.save(tasd, 1)
    (name,) = os.listdir(manager.local_ckpt_dir)
    return os.path.join(manager.local_ckpt_dir, name)


def load_local(directory):
    manager = LocalCheckpointManager(directory)
    if manager.find_latest() != 1:
        raise AssertionError(f"rank {RANK}: nvrx finds no complete local checkpoint in {directory}")
    tasd, _ = manager.load()
    return tasd


def saved_bytes(path, prefix):
    """The bytes of the tensors this rank's local checkpoint file holds under keys starting with
    `prefix`, counted by their storages as the file has them (a view of a bigger tensor would bring
    all of its storage along)."""
    tasd = torch.load(path, weights_only=False)
    total = 0
    for sh in nested_values(tasd.sharded_state_dict):
        if isinstance(sh, ShardedTensor) and sh.data is not None and sh.key.startswith(prefix):
            total += sh.data.untyped_storage().nbytes()
    return total


def gathered(obj):
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


def together(step, *args):
    """Runs `step(*args)` on every rank and returns its result; if it raised on any rank, raises on
    every rank (naming them), so that no rank goes on to a collective the others never reach."""
    try:
        result, failure = step(*args), None
    except Exception as e:  # noqa: BLE001 (reported to every rank)
        import traceback
        result, failure = None, traceback.format_exc()
    failures = [(r, f) for r, f in enumerate(gathered(failure)) if f is not None]
    if failures:
        raise AssertionError("\n".join(f"rank {r} failed:\n{f}" for r, f in failures))
    return result


def check_equal(got, want, what):
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype or \
            got.device != want.device or not torch.equal(got, want):
        at = (got != want).nonzero()[:1].tolist() if isinstance(got, torch.Tensor) and got.shape == want.shape else []
        raise AssertionError(f"rank {RANK}: {what}: got {getattr(got, 'dtype', type(got).__name__)} "
                             f"{tuple(getattr(got, 'shape', ()))} on {getattr(got, 'device', None)}, want {want.dtype} "
                             f"{tuple(want.shape)} on {want.device}; first difference at {at}")


def check_loaded(out, request, saved_dtype, where):
    """The state dict to_state_dict gave: the shard and its optimizer state are the tensors `request`
    asked for (their device and dtype), real rows the saved values, pad rows zero; plain tensors and
    values as saved; the local non-persistent value this rank's."""
    g = request.gtp_rank
    weight, exp_avg = out["model"][KEY], out["optimizer"]["exp_avg"]
    if weight is not request.weight or exp_avg is not request.exp_avg:
        raise AssertionError(f"rank {RANK}: {where}: the shard and its optimizer state are not the tensors the load "
                             f"asked for ({type(weight).__name__}, {type(exp_avg).__name__})")
    check_equal(weight, expected(g, saved_dtype).to(request.dtype), f"{where}: in_proj.weight (GTP rank {g})")
    check_equal(exp_avg, expected(g, saved_dtype, base=50).to(request.dtype), f"{where}: its exp_avg (GTP rank {g})")
    if g == 63 and (weight.any() or exp_avg.any()):
        raise AssertionError(f"rank {RANK}: {where}: the padding-only shard is not all zero")
    if g == 62 and (not weight[:256].ne(0).all() or weight[256:].any()):
        raise AssertionError(f"rank {RANK}: {where}: GTP rank 62 is not 256 real rows and 736 zero rows")
    check_equal(out["model"][PREFIX + "norm.weight"].to(request.dtype), (torch.arange(C)).to(request.dtype),
                f"{where}: norm.weight")
    check_equal(out["optimizer"]["step"], torch.tensor(3), f"{where}: optimizer step (a plain tensor)")
    for k, v in COMMON.items():
        if out[k] != v:
            raise AssertionError(f"rank {RANK}: {where}: common value {k}: {out[k]!r}, saved {v!r}")
    if out["rng"] != "this rank's":
        raise AssertionError(f"rank {RANK}: {where}: the local non-persistent value is {out.get('rng')!r}")


def round_trip(directory, layout, saved_dtype, requested_dtype, algo, how, exchange="broadcast"):
    where = f"{layout}, {saved_dtype} -> {requested_dtype}, {algo}{f' ({exchange})' if algo != 'atomic' else ''}, {how}"
    path = os.path.join(directory, f"{layout}.{algo}.{how}.{str(saved_dtype)[6:]}.{str(requested_dtype)[6:]}")
    saving = Rank(layout, saved_dtype)
    mine = save_local(path, saving.state_dict(), algo)
    # Nothing of the padding saved: this rank's file holds, for the shard and its optimizer state, the
    # real rows of the pieces it saved. Atomic: its own; fully_parallel: each distinct shard once
    # between its replicas.
    size = torch.empty(0, dtype=saved_dtype).element_size()
    for prefix, what in ((KEY, "in_proj.weight"), ("optimizer.state.exp_avg." + KEY, "exp_avg")):
        got = gathered(saved_bytes(mine, prefix))
        if algo == "atomic":
            want = [REAL[g] * C * size for g, _ in LAYOUTS[layout]]
            if got != want:
                raise AssertionError(f"rank {RANK}: {where}: the ranks' files hold {got} bytes of {what}, "
                                     f"the real rows are {want}")
        elif sum(got) != sum(REAL[g] for g in {g for g, _ in LAYOUTS[layout]}) * C * size:
            raise AssertionError(f"rank {RANK}: {where}: the ranks' files hold {got} bytes of {what}, not each "
                                 "shard's real rows once")
    tasd = load_local(path)
    request = Rank(layout, requested_dtype, fill=5)

    def load_and_check():  # collectives inside Megatron come before any check
        if how == "megatron":
            out = tasd.to_state_dict(request.state_dict(), algo=algo, exchange_algo=exchange,
                                     parallelization_group=group())
        else:
            out = to_state_dict(tasd, request.state_dict(), algo=algo, exchange_algo=exchange,
                                parallelization_group=group())
        check_loaded(out, request, saved_dtype, where)
    together(load_and_check)
    dist.barrier()
    if RANK == 0:
        shutil.rmtree(path)


# ----------------------------------------------------------------------------------------------- cases

def case_seed_atomic(directory):
    """The seed geometry through a local checkpoint with algo "atomic", every rank saving its own file:
    Megatron's own to_state_dict and shardckpt's, bf16 and fp32 saved as they are asked for, and bf16
    asked for as fp32."""
    for layout in LAYOUTS:
        for saved, requested, how in [(torch.bfloat16, torch.bfloat16, "megatron"), (torch.float32, torch.float32, "megatron"),
                                      (torch.bfloat16, torch.float32, "megatron"), (torch.bfloat16, torch.bfloat16, "shardckpt")]:
            round_trip(directory, layout, saved, requested, "atomic", how)


def case_seed_fully_parallel(directory):
    """The same with algo "fully_parallel" over the 4 ranks: one replica of each shard saved, the other
    rank given it on load by Megatron's exchange (its default "broadcast", and "gather_object"), the
    padding-only placeholder included."""
    for layout in LAYOUTS:
        # (Megatron's "broadcast" exchange receives into a tensor of the dtype asked for: a checkpoint
        # of another dtype needs "gather_object", which sends the saved tensors as they are.)
        for saved, requested, how, exchange in [(torch.bfloat16, torch.bfloat16, "megatron", "broadcast"),
                                                (torch.float32, torch.float32, "megatron", "broadcast"),
                                                (torch.bfloat16, torch.float32, "megatron", "gather_object"),
                                                (torch.bfloat16, torch.bfloat16, "shardckpt", "broadcast")]:
            round_trip(directory, layout, saved, requested, "fully_parallel", how, exchange)


def case_placeholder(directory):
    """What the factory builds: on a padding-only rank one zero-element ShardedTensor of the shard's
    dtype under the last block's key, at the end of the block (no real piece starts there), a main
    replica on one rank of those that share it; elsewhere the pieces, views of the shard."""
    for layout in LAYOUTS:
        together(_check_built, layout)


def _check_built(layout):
    r = Rank(layout, torch.bfloat16)
    built = r.state_dict()["model"][KEY].build()
    (key, pieces), = built.items()
    if key != KEY:
        raise AssertionError(f"rank {RANK}: the build's entry is {key!r}")
    if r.gtp_rank == 63:
        (p,) = pieces
        want = (KEY + ".dt", (0, C), (448, C), (448, 0), torch.bfloat16)
        if (p.key, p.local_shape, p.global_shape, p.global_offset, p.dtype) != want or p.data.numel() != 0:
            raise AssertionError(f"rank {RANK}: placeholder {p}, want {want}")
    else:
        rows = sum(p.local_shape[0] for p in pieces)
        if rows != REAL[r.gtp_rank] or any(p.data.untyped_storage().data_ptr() != r.weight.data_ptr() for p in pieces):
            raise AssertionError(f"rank {RANK}: pieces {pieces} are not views of the {REAL[r.gtp_rank]} real rows")


def _placeholder_mains(layout):
    """The placeholders this rank builds that are main replicas."""
    r = Rank(layout, torch.bfloat16)
    (pieces,) = r.state_dict()["model"][KEY].build().values()
    return [p.global_offset for p in pieces if p.data.numel() == 0 and all(i == 0 for i in p.replica_id)]


def case_placeholder_main(directory):
    """Where GTP rank 63 has two data-parallel replicas, exactly one of them builds a main placeholder."""
    mains = gathered(_placeholder_mains("tail"))
    if sum(len(m) for m in mains) != 1:
        raise AssertionError(f"rank {RANK}: the placeholder's main replicas, by rank: {mains}")


def case_no_gather(directory):
    """A real MambaMixer GTP-sharded by Megatron (TP 1 x GTP 4, 83 rows: GTP rank 2 partly padded, 3
    padding-only) after no_gather, with its factory that keeps the shard as a LocalNonpersistentObject:
    Megatron's own to_state_dict refuses it (documented here, not required); shardckpt's to_state_dict
    gives each rank its shard in place, pad rows zero, the other weights and values as saved, with
    "atomic" and "fully_parallel"."""
    import mamba_worker as mw
    for algo in ("atomic", "fully_parallel"):
        path = os.path.join(directory, f"no_gather.{algo}")
        s = mw.Setup(mw.PADDED, 1, 4)
        no_gather(s.mixer)
        others = {k: v.detach().clone() for k, v in s.mixer.state_dict().items() if not k.endswith("in_proj.weight")
                  and isinstance(v, torch.Tensor)}
        mine = save_local(path, {"model": s.sharded(), **COMMON}, algo)
        got = gathered(saved_bytes(mine, mw.KEY))
        real = sum(mw.PADDED.blocks(1))  # 83 rows, shards of s.rows
        want = [max(0, min(real - g * s.rows, s.rows)) * mw.PADDED.hidden * 2 for g in range(4)]
        if sum(got) != sum(want) or (algo == "atomic" and got != want):
            raise AssertionError(f"rank {RANK}: no_gather, {algo}: the files hold {got} bytes of in_proj, real rows {want}")
        tasd = load_local(path)
        s = mw.Setup(mw.PADDED, 1, 4, base=1)
        no_gather(s.mixer)
        s.weight.data.fill_(-7)
        try:
            tasd.to_state_dict(s.sharded(), algo=algo, parallelization_group=group())
            print(f"local_worker: rank {RANK}: Megatron's own to_state_dict took no_gather's factory ({algo})", flush=True)
        except Exception as e:  # megatron-core 0.19.2: its merges run on the sharded part alone
            print(f"local_worker: rank {RANK}: Megatron's own to_state_dict, {algo}: {type(e).__name__}: {e}"[:300],
                  flush=True)
        tasd = load_local(path)
        together(_check_no_gather, tasd, s, algo, others)
        dist.barrier()


def _check_no_gather(tasd, s, algo, others):
    import mamba_worker as mw
    out = to_state_dict(tasd, {"model": s.sharded(), **COMMON}, algo=algo, parallelization_group=group())
    if out["model"][mw.KEY] is not s.weight:
        raise AssertionError(f"rank {RANK}: no_gather, {algo}: to_state_dict did not give the mixer's shard")
    check_equal(s.weight.detach(), s.expected(), f"no_gather, {algo}: in_proj.weight (GTP rank {s.gtp_rank})")
    s.mixer.load_state_dict({k[len(mw.PREFIX):]: v for k, v in out["model"].items()}, strict=True)
    for k, v in s.mixer.state_dict().items():
        if k in others:
            check_equal(v, others[k], f"no_gather, {algo}: {k}")
    for k, v in COMMON.items():
        if out[k] != v:
            raise AssertionError(f"rank {RANK}: no_gather, {algo}: common value {k}: {out[k]!r}")


CASES = {"seed_atomic": case_seed_atomic, "seed_fully_parallel": case_seed_fully_parallel,
         "placeholder": case_placeholder, "placeholder_main": case_placeholder_main, "no_gather": case_no_gather}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        run_cases(CASES, sys.argv[1], RANK)
    finally:
        dist.destroy_process_group()
