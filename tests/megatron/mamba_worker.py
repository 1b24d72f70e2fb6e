"""One process of a gloo job under megatron-core 0.19 (tests/megatron/test_mamba.py): a real
MambaMixer on CPU whose in_proj.weight is GTP-sharded by Megatron itself (initialize_model_parallel
with gtp_remat_size: ColumnParallelLinear slices it with _gtp_slice_one_param and marks it with
_gtp_attach_attrs), saved and loaded after shardckpt's no_gather(model). Runs every case named on the
command line against checkpoints in DIR and writes, for each, "ok" or the failure's traceback to
DIR/<case>.<rank>.json.

GTP needs Transformer Engine (HAVE_GTP is False without it): the worker sets HAVE_GTP where 0.19 reads
it, so that Megatron's own GTP paths (the gather of MambaMixer.sharded_state_dict, the GTP offsets of
out_proj) run as they do with Transformer Engine. The mixer's forward needs mamba_ssm's kernels; only
its constructor checks for them, and no forward runs here."""
import contextlib
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Megatron calls these on CPU too (it has no CPU path of its own).
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.ssm import mamba_mixer  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl  # noqa: E402
from megatron.core.tensor_parallel import gtp_api  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import shardckpt as sc  # noqa: E402
from shardckpt._no_gather import no_gather  # noqa: E402
from support import run_cases  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
PREFIX = "decoder.layers.0.mixer."
KEY = PREFIX + "in_proj.weight"
NAMES = ("z", "x", "B", "C", "dt")
BACKENDS = [("torch_dist", 1)]
try:
    import shardckpt.megatron  # noqa: E402,F401  (registers the "shardckpt" backend)
    BACKENDS.append(("shardckpt", 1))
except ImportError as e:  # a shardckpt.megatron written for another megatron-core
    print(f"mamba_worker: the shardckpt backend is not tested: {e}", flush=True)

# As Transformer Engine makes them: GTP on, where 0.19 reads it.
gtp_api.HAVE_GTP = True
mamba_mixer.HAVE_GTP = True
mamba_mixer.is_gtp_param = gtp_api.is_gtp_param
mamba_mixer.HAVE_MAMBA_SSM = True  # its kernels serve only the forward


class Dims:
    """A mixer's sizes. EVEN: 8 heads of 16, 2 groups of state 16, hidden 64 (in_proj 328 rows).
    PADDED: 3 heads of 8, 1 group of state 16 (83 rows): at GTP 4 and alignment 16, a shard of 32 rows,
    GTP rank 2 holds 19 real rows (C and dt) and rank 3 none (padding-only)."""

    def __init__(self, heads, head_dim, groups, state, hidden=64):
        self.heads, self.head_dim, self.groups, self.state, self.hidden = heads, head_dim, groups, state, hidden

    def blocks(self, tp=1):
        """The TP-local rows of z, x, B, C, dt at TP `tp`."""
        d, gs = self.heads * self.head_dim // tp, self.groups * self.state // tp
        return [d, d, gs, gs, self.heads // tp]


EVEN = Dims(8, 16, 2, 16)
PADDED = Dims(3, 8, 1, 16)


def value(block, rows, cols, base):
    """Global block `block`'s rows `rows` (a range): small integers, exact in bf16, from the block,
    the global row and the column, so that a row in the wrong place is seen."""
    r = torch.arange(rows.start, rows.stop, dtype=torch.float64)[:, None]
    c = torch.arange(cols, dtype=torch.float64)[None, :]
    return (((block * 37 + r * 7 + c * 3 + base) % 241) - 120).to(torch.bfloat16)


def tp_local(dims, tp, tp_rank, base=0):
    """The TP-local in_proj weight (or an optimizer state, by `base`) of TP rank `tp_rank`."""
    return torch.cat([value(b, range(tp_rank * s, (tp_rank + 1) * s), dims.hidden, base)
                      for b, s in enumerate(dims.blocks(tp))])


def shard(full, gtp, gtp_rank, rows):
    """GTP rank `gtp_rank`'s shard of `rows` rows of TP-local `full`, pad rows zero (Megatron's
    _gtp_slice_one_param: the tail padded, then sliced)."""
    padded = torch.nn.functional.pad(full, (0, 0, 0, rows * gtp - full.shape[0]))
    return padded[gtp_rank * rows:(gtp_rank + 1) * rows].clone()


class Setup:
    """parallel_state at TP `tp` and GTP `gtp` over the 4 ranks, and a MambaMixer of `dims` built there
    (bf16, CPU), in_proj GTP-sharded by Megatron when gtp > 1, every weight set from `base`."""

    def __init__(self, dims, tp, gtp, base=0):
        parallel_state.destroy_model_parallel()
        gtp_impl.reset_gtp_state()
        parallel_state.initialize_model_parallel(tp, gtp_remat_size=gtp)
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        self.dims, self.tp, self.gtp = dims, tp, gtp
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.gtp_rank = parallel_state.get_gtp_weight_remat_rank() if gtp > 1 else 0
        cfg = TransformerConfig(num_layers=1, hidden_size=dims.hidden, num_attention_heads=4,
                                use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, mamba_state_dim=dims.state,
                                mamba_head_dim=dims.head_dim, mamba_num_groups=dims.groups,
                                mamba_num_heads=dims.heads, tensor_model_parallel_size=tp)
        self.mixer = mamba_mixer.MambaMixer(
            cfg, mamba_mixer.MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
            d_model=dims.hidden, rmsnorm=False, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        self.weight = self.mixer.in_proj.weight
        self.rows = self.weight.shape[0]  # the shard's, pad rows included
        expect_gtp = gtp > 1
        assert gtp_api.is_gtp_param(self.weight) == expect_gtp, (type(self.weight), gtp)
        with torch.no_grad():
            self.weight.copy_(self.expected(base))
            for i, p in enumerate(self.mixer.parameters()):
                if p is not self.weight:
                    p.copy_(torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape).mul(0.25).add(i + base)
                            .to(p.dtype))

    def expected(self, base=0):
        """This rank's in_proj weight (or optimizer state by `base`): its shard under GTP."""
        full = tp_local(self.dims, self.tp, self.tp_rank, base)
        return shard(full, self.gtp, self.gtp_rank, self.rows) if self.gtp > 1 else full

    def sharded(self):
        return self.mixer.sharded_state_dict(prefix=PREFIX)

    def optimizer(self, bases=None):
        """Megatron's FP32Optimizer over torch's Adam (made on CPU: its constructor puts a scale on CUDA),
        its exp_avg and exp_avg_sq set from `bases` (or zero, as a load's init_state_fn makes them)."""
        adam = torch.optim.Adam(list(self.mixer.parameters()), lr=0.1)

        def init_state(opt, config=None):
            for group in opt.param_groups:
                for p in group["params"]:
                    if not opt.state[p]:
                        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                        "exp_avg_sq": torch.zeros_like(p)}
        opt = FP32Optimizer.__new__(FP32Optimizer)
        MegatronOptimizer.__init__(opt, adam, OptimizerConfig(lr=0.1, bf16=True), init_state)
        opt._scale, opt.is_stub_optimizer = torch.ones(1), False
        init_state(adam)
        if bases is not None:
            with torch.no_grad():
                for name, b in zip(("exp_avg", "exp_avg_sq"), bases):
                    adam.state[self.weight][name].copy_(self.expected(b))
        return opt


@contextlib.contextmanager
def counting():
    """Counts the calls of torch.distributed's collectives in the block (the dict it yields)."""
    names = ["all_gather_into_tensor", "all_gather", "all_gather_object", "all_reduce", "broadcast", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "send", "recv"]
    calls = {}
    saved = {n: getattr(dist, n) for n in names}

    def wrap(n, f):
        def call(*a, **k):
            calls[n] = calls.get(n, 0) + 1
            return f(*a, **k)
        return call
    for n in names:
        setattr(dist, n, wrap(n, saved[n]))
    try:
        yield calls
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def tensors(sharded):
    """{key: [ShardedTensor, ...]} of a sharded state dict after its factories (a copy)."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    sd, _ = extract_matching_values(sharded, lambda x: True)
    apply_factories(sd)
    out = {}
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            out.setdefault(v.key, []).append(v)
    return out


def gathered(obj, group=None):
    out = [None] * (dist.get_world_size(group))
    dist.all_gather_object(out, obj, group=group)
    return out


def check_equal(got, want, what):
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        at = (got != want).nonzero()[0].tolist() if got.shape == want.shape else []
        raise AssertionError(f"rank {RANK}: {what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} "
                             f"{tuple(want.shape)}; first difference at {at}: got "
                             f"{got[tuple(at)].item() if at else None}, want {want[tuple(at)].item() if at else None}")


def in_storage(view, base):
    """True when `view` is a view of `base`'s memory."""
    start, size = base.data_ptr(), base.numel() * base.element_size()
    return start <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= start + size


# ----------------------------------------------------------------------------------------------- cases

def case_pieces(directory):
    """At TP 1 x GTP 4, TP 2 x GTP 2 and TP 1 x GTP 2 (two replicas) of the even mixer and TP 1 x GTP 4 of
    the padded one: Megatron's own save gathers (one all_gather_into_tensor); after no_gather the mixer
    calls no collective, and its in_proj pieces have exactly the keys and global shapes of Megatron's
    (and of the mixer without GTP), each a view of the shard holding the values Megatron's gathered
    block holds at its rows; over the ranks the main pieces tile every block once (no pad row in any);
    the pieces are the library's (ShardedParam with align = GTP_CONFIG.pad_for_alignment)."""
    for dims, tp, gtp in [(EVEN, 1, 4), (EVEN, 2, 2), (EVEN, 1, 2), (PADDED, 1, 4)]:
        where = f"TP {tp} x GTP {gtp}, {dims.heads} heads"
        s = Setup(dims, tp, 1)
        plain = {k: (v[0].global_shape, v[0].dtype) for k, v in tensors(s.sharded()).items()}
        s = Setup(dims, tp, gtp)
        with torch.no_grad(), counting() as calls:  # gloo's all_gather refuses a tensor that requires grad
            theirs = s.sharded()
        if calls.get("all_gather_into_tensor") != 1:
            raise AssertionError(f"{where}: Megatron's own save made {calls}, expected one all_gather_into_tensor")
        theirs = tensors(theirs)
        with counting() as calls:
            no_gather(s.mixer)
            ours = s.sharded()
        patched = s.mixer.__dict__["sharded_state_dict"]
        if no_gather([s.mixer]) != [s.mixer] or s.mixer.__dict__["sharded_state_dict"] is not patched:
            raise AssertionError("no_gather twice wrapped the mixer twice (or did not return the model)")
        if calls:
            raise AssertionError(f"{where}: no_gather's sharded_state_dict called collectives {calls}")
        ours = tensors(ours)
        # Each rank has the pieces of the blocks its shard meets; all ranks together, every key.
        everyone = set().union(*gathered(sorted(ours)))
        if everyone != set(theirs) or everyone != set(plain) or \
                {k for k in ours if not k.startswith(KEY)} != {k for k in theirs if not k.startswith(KEY)}:
            raise AssertionError(f"{where}: keys {sorted(everyone ^ set(theirs))} differ from Megatron's, "
                                 f"{sorted(everyone ^ set(plain))} from the mixer's without GTP")
        mine = []
        for key, shs in ours.items():
            if (shs[0].global_shape, shs[0].dtype) != plain[key] or theirs[key][0].global_shape != plain[key][0]:
                raise AssertionError(f"{where}: {key}: {shs[0].global_shape}, without GTP {plain[key]}")
            if not key.startswith(KEY + "."):
                continue
            whole = theirs[key][0]  # Megatron's: the TP rank's whole block, gathered
            for sh in shs:
                if sh.axis_fragmentations is not None or sh.flattened_range is not None:
                    raise AssertionError(f"{key}: {sh}")
                if not in_storage(sh.data, s.weight) or sh.data.requires_grad:
                    raise AssertionError(f"{where}: {key}: a piece that is not a detached view of the shard")
                row = sh.global_offset[0] - whole.global_offset[0]
                check_equal(sh.data, whole.data[row:row + sh.local_shape[0]], f"{where}: {key} at {sh.global_offset}")
                main = all(r == 0 for r in sh.replica_id)
                mine.append((key, sh.global_offset[0], sh.local_shape[0], main, sh.global_shape[0]))
        # The library's pieces, at Megatron's alignment: the same rows, the same shard.
        spec = sc.ParamSpec(KEY, [sc.Section(n, r) for n, r in zip(NAMES, dims.blocks(tp))], [dims.hidden], tp=tp)
        lib = sc.ShardedParam(spec, gtp=gtp, align=gtp_impl.GTP_CONFIG.pad_for_alignment, tp_rank=s.tp_rank,
                              gtp_rank=s.gtp_rank)
        if tuple(lib.padded_shape()) != tuple(s.weight.shape) or \
                s.weight.pad_length != gtp_impl.gtp_remat_shard_dim0(sum(dims.blocks(tp)), s.weight.group)[1]:
            raise AssertionError(f"{where}: library shard {lib.padded_shape()}, Megatron's {tuple(s.weight.shape)}")
        want = sorted((p["key"], p["global_offset"][0], p["rows"], p["global_shape"][0]) for p in lib.pieces())
        if sorted((k, o, n, g) for k, o, n, _, g in mine) != want:
            raise AssertionError(f"{where}: pieces {sorted(mine)}, the library's {want}")
        # Over every rank: the main pieces of each block cover its rows once.
        cover = {}
        for key, offset, rows, main, total in (m for ms in gathered(mine) for m in ms):
            if main:
                cover.setdefault(key, [0] * total)
                for r in range(offset, offset + rows):
                    cover[key][r] += 1
        bad = {k: c for k, c in cover.items() if any(x != 1 for x in c)}
        if bad or len(cover) != len(NAMES):
            raise AssertionError(f"{where}: blocks not tiled once by the main pieces: {sorted(cover)}, {bad}")
        if dims is PADDED and s.gtp_rank == 3 and any(m[0].startswith(KEY) for m in mine):
            raise AssertionError("the padding-only rank gave pieces")


def save(s, opt, path, backend):
    model = s.sharded()
    sd = {"model": model, "optimizer": opt.sharded_state_dict(model)} if opt is not None else {"model": model}
    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(sd, path, sharded_strategy=backend)


def load(s, opt, path, bases, in_place=True):
    """Loads `path` into `s` (and `opt`): the in_proj shard is filled in place (pad rows zeroed) by
    dist_checkpointing.load itself (`in_place`: not so by Megatron's own GTP load, which merges a
    TP-local weight and slices it); then model.load_state_dict and the optimizer's load_state_dict take
    what it returns. Checks the shard and the Adam states against the reference."""
    s.weight.data.fill_(-7)  # pad rows too: the load zeroes them
    ptr = s.weight.data_ptr()
    if opt is not None:
        for name in ("exp_avg", "exp_avg_sq"):
            opt.optimizer.state[s.weight][name].fill_(-7)
    model = s.sharded()
    sd = {"model": model}
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(model, is_loading=True)
    loaded = dist_checkpointing.load(sd, path)
    where = f"TP {s.tp} x GTP {s.gtp} (GTP rank {s.gtp_rank})"
    if in_place:
        check_equal(s.weight.detach(), s.expected(), f"{where}: in_proj.weight right after dist_checkpointing.load")
    s.mixer.load_state_dict({k[len(PREFIX):]: v for k, v in loaded["model"].items()}, strict=True)
    if s.weight.data_ptr() != ptr:
        raise AssertionError("the shard moved")
    check_equal(s.weight.detach(), s.expected(), f"{where}: in_proj.weight after load_state_dict")
    if opt is not None:
        opt.load_state_dict(loaded["optimizer"])
        state = opt.optimizer.state[s.weight]
        for name, b in zip(("exp_avg", "exp_avg_sq"), bases):
            check_equal(state[name], s.expected(b), f"{where}: Adam {name} of in_proj.weight")


def case_save_load(directory):
    """Under torch_dist, and the shardckpt backend where shardckpt.megatron imports under this
    megatron-core (BACKENDS): a save at TP 1 x GTP 4 after no_gather (model and
    Megatron's optimizer state for plain Adam) loads at TP 2 x GTP 2 after no_gather (in place, pad
    rows zero), at TP 2 without GTP, and at TP 2 x GTP 2 by Megatron's own gathering load; a save
    without GTP loads at TP 1 x GTP 4 after no_gather."""
    bases = (3, 5)
    for backend in BACKENDS:
        path = os.path.join(directory, f"save_load.{backend[0]}")
        s = Setup(EVEN, 1, 4)
        no_gather(s.mixer)
        save(s, s.optimizer(bases), path, backend)
        s = Setup(EVEN, 2, 2, base=1)
        no_gather(s.mixer)
        load(s, s.optimizer(), path, bases)
        s = Setup(EVEN, 2, 1, base=1)
        load(s, s.optimizer(), path, bases)
        s = Setup(EVEN, 2, 2, base=1)
        with torch.no_grad():  # Megatron's own GTP path: its load merges the blocks and slices the shard
            load(s, None, path, bases, in_place=False)
        plain = os.path.join(directory, f"plain.{backend[0]}")
        s = Setup(EVEN, 2, 1)
        save(s, s.optimizer(bases), plain, backend)
        s = Setup(EVEN, 1, 4, base=1)
        no_gather(s.mixer)
        load(s, s.optimizer(), plain, bases)


def case_padding_only(directory):
    """The padded mixer at TP 1 x GTP 4 (rank 3 padding-only, rank 2 partly padded), under BACKENDS:
    saved after no_gather, it loads without GTP, and back at GTP 4 after no_gather, where the
    padding-only rank gets its whole shard zeroed in place and every pad row is zero."""
    bases = (2, 9)
    for backend in BACKENDS:
        path = os.path.join(directory, f"padding_only.{backend[0]}")
        s = Setup(PADDED, 1, 4)
        if s.gtp_rank == 3 and s.expected().any():
            raise AssertionError("rank 3 is not padding-only")
        no_gather(s.mixer)
        save(s, s.optimizer(bases), path, backend)
        s = Setup(PADDED, 1, 1, base=1)
        load(s, s.optimizer(), path, bases)
        s = Setup(PADDED, 1, 4, base=1)
        no_gather(s.mixer)
        load(s, s.optimizer(), path, bases)


def case_refused(directory):
    """A flattened range (the distributed optimizer's fully_sharded_model_space) and a quantized
    in_proj are refused with a CheckpointingException naming the key and the rank."""
    s = Setup(EVEN, 1, 4)
    no_gather(s.mixer)
    factory = s.sharded()[KEY]
    flat = factory.__class__(factory.key, factory.data, factory.build_fn, factory.merge_fn, factory.replica_id,
                             flattened_range=slice(0, 10))
    expect_refused(flat.build, [KEY, f"rank {RANK}", "flattened range"])
    s.weight._gtp_native_fp8 = True
    expect_refused(s.sharded, [KEY, f"rank {RANK}", "quantized"])


def expect_refused(call, words):
    try:
        call()
    except CheckpointingException as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            raise AssertionError(f"the refusal {e!r} does not say {missing}") from e
        return
    raise AssertionError(f"not refused (expected a CheckpointingException saying {words})")


CASES = {"pieces": case_pieces, "save_load": case_save_load, "padding_only": case_padding_only,
         "refused": case_refused}

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        run_cases(CASES, sys.argv[1], RANK)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
