"""One process of a gloo job under megatron-core 0.16 or 0.19 and torch 2.x (tests/megatron/test_megatron.py):
runs every case named on the command line against checkpoints in DIR and writes, for each, "ok" or
the failure's traceback to DIR/<case>.<rank>.json. Every rank builds the same reference tensors
(values from their indices), so each checks what it loads against the whole tensor without a
collective."""
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Megatron's torch_dist strategy calls these on CPU too (it has no CPU path of its own).
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import shardckpt as sc  # noqa: E402
import shardckpt.megatron as scm  # noqa: E402
from support import reference, run_cases, spec_at  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
L, H, F, VOCAB = 4, 8, 12, 10
# megatron-core 0.16 registers the backend by name; 0.18 and later take the strategy objects.
NEW = not scm.REGISTRY
BACKEND = scm.SaveStrategy() if NEW else ("shardckpt", 1)


def load(sd, path, **kwargs):
    """dist_checkpointing.load as a user of this Megatron writes it: on 0.19 with the strategy object
    for a shardckpt checkpoint; on 0.16 without one (Megatron finds ours in metadata.json)."""
    if NEW and "sharded_strategy" not in kwargs and scm._ours(path):
        kwargs["sharded_strategy"] = scm.LoadStrategy()
    return dist_checkpointing.load(sd, path, **kwargs)


def common_files():
    """What Megatron itself writes beside the backend's file: common.pt up to 0.17."""
    return [] if NEW else ["common.pt"]


def ref(shape, dtype=torch.float32, base=0):
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + base).to(dtype)


def expect_equal(got, want, what):
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.dtype} {tuple(got.shape)} {got.flatten()[:6].tolist()}, "
                             f"want {want.dtype} {tuple(want.shape)} {want.flatten()[:6].tolist()}")


def padded_vocab(tp):
    return -(-VOCAB // (6 * tp)) * 6 * tp


class Layout:
    """A rank's place: TP x PP x DP over the world, rank = (dp * PP + pp) * TP + tp."""

    def __init__(self, tp, pp=1):
        self.tp, self.pp, self.dp = tp, pp, WORLD // (tp * pp)
        self.tp_rank = RANK % tp
        self.pp_rank = (RANK // tp) % pp
        self.dp_rank = RANK // (tp * pp)

    def layers(self):
        per = L // self.pp
        return range(self.pp_rank * per, (self.pp_rank + 1) * per)


def cut(full, axis, part, parts):
    size = full.shape[axis] // parts
    return full.narrow(axis, part * size, size)


def model_state(lay, fill=True, flat_split=None, rng=True):
    """A Megatron model and optimizer state dict as its layers build them, at layout `lay`: a
    vocabulary-parallel embedding with a padded vocabulary, layer-stacked column- and row-parallel
    weights and a replicated norm (prepend_axis_num=1, one ShardedTensor per layer), a bf16 weight, a
    replicated final norm, the distributed optimizer's flat shards (dp_reshardable: uneven 1-D parts
    at global offsets), ShardedObjects and common values. `fill`: the reference values, else -1."""
    def value(full):
        return full.clone() if fill else torch.full_like(full, -1)

    t, T, dp = lay.tp_rank, lay.tp, lay.dp_rank
    sd = {}
    emb = ref((padded_vocab(T), H), base=5000)
    if lay.pp_rank == 0:
        sd["embedding.word_embeddings.weight"] = ShardedTensor.from_rank_offsets(
            "embedding.word_embeddings.weight", value(cut(emb, 0, t, T)), (0, t, T), replica_id=(0, 0, dp),
            allow_shape_mismatch=True)
    fc1, fc2, ln = ref((L, F, H), base=1000), ref((L, H, F), base=2000), ref((L, H), base=3000)
    for i, l in enumerate(lay.layers()):
        p = f"decoder.layers.{i}."
        sd[p + "mlp.linear_fc1.weight"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc1.weight", value(cut(fc1[l], 0, t, T)), (0, l, L), (1, t, T),
            replica_id=(0, 0, dp), prepend_axis_num=1)
        sd[p + "mlp.linear_fc2.weight"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc2.weight", value(cut(fc2[l], 1, t, T)), (0, l, L), (2, t, T),
            replica_id=(0, 0, dp), prepend_axis_num=1)
        sd[p + "input_layernorm.weight"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.input_layernorm.weight", value(ln[l]), (0, l, L), replica_id=(0, t, dp),
            prepend_axis_num=1)
    if lay.pp_rank == lay.pp - 1:
        sd["decoder.final_layernorm.weight"] = ShardedTensor.from_rank_offsets(
            "decoder.final_layernorm.weight", value(ref((H,), base=4000)), replica_id=(0, t, dp))
        qkv = ref((3 * H, H), torch.bfloat16, base=-20)
        sd["output_layer.weight"] = ShardedTensor.from_rank_offsets(
            "output_layer.weight", value(cut(qkv, 0, t, T)), (0, t, T), replica_id=(0, 0, dp))
    if lay.pp_rank == 0:  # a bool buffer, replicated
        mask = torch.arange(H) % 3 == 0
        sd["decoder.mask"] = ShardedTensor.from_rank_offsets(
            "decoder.mask", mask if fill else torch.zeros(H, dtype=torch.bool), replica_id=(0, t, dp))
    if rng:  # a ShardedObject keeps its sharding: loaded at the TP and PP that saved it
        sd["rng_state"] = ShardedObject("rng_state", {"seed": 1234 + RANK, "state": torch.arange(4) + RANK} if fill
                                        else None, (lay.pp, T), (lay.pp_rank, t), replica_id=dp)
    if flat_split is not None:  # the distributed optimizer's flat shards of this TP rank's buffer
        n = 37
        key = f"optimizer.distributed.dp_group_idx_{t}.gbuf_0.param"
        bounds = flat_split(n, lay.dp)
        begin, end = bounds[dp], bounds[dp + 1]
        full = ref((n,), base=100 * t)
        sd["optimizer.flat"] = ShardedTensor(key, value(full[begin:end]), torch.float32, (end - begin,), (n,),
                                             (begin,), axis_fragmentations=None, replica_id=(0, 0, 0))
        sd["optimizer.param_groups"] = ShardedObject(
            f"optimizer.distributed.dp_group_idx_{t}.param_groups", {"lr": 0.1, "tp": t} if fill else None,
            (1,), (0,), replica_id=(0, 0, dp))
    sd["iteration"] = 100
    sd["args"] = {"lr": 0.1, "name": "test"}
    return sd


def check_model(lay, loaded, saved_tp, flat_split=None, rng=True):
    t, T = lay.tp_rank, lay.tp
    saved_vocab, vocab = padded_vocab(saved_tp), padded_vocab(T)
    if lay.pp_rank == 0:
        rows = vocab // T
        want = torch.zeros(rows, H)  # rows past the saved vocabulary: zero, as Megatron's torch_dist makes them
        full = ref((saved_vocab, H), base=5000)
        for r in range(rows):
            g = t * rows + r
            if g < saved_vocab:
                want[r] = full[g]
        expect_equal(loaded["embedding.word_embeddings.weight"], want, "embedding (padded vocabulary)")
    fc1, fc2, ln = ref((L, F, H), base=1000), ref((L, H, F), base=2000), ref((L, H), base=3000)
    for i, l in enumerate(lay.layers()):
        p = f"decoder.layers.{i}."
        expect_equal(loaded[p + "mlp.linear_fc1.weight"], cut(fc1[l], 0, t, T), f"fc1 of layer {l}")
        expect_equal(loaded[p + "mlp.linear_fc2.weight"], cut(fc2[l], 1, t, T), f"fc2 of layer {l}")
        expect_equal(loaded[p + "input_layernorm.weight"], ln[l], f"norm of layer {l}")
    if lay.pp_rank == 0:
        expect_equal(loaded["decoder.mask"], torch.arange(H) % 3 == 0, "bool buffer")
    if lay.pp_rank == lay.pp - 1:
        expect_equal(loaded["decoder.final_layernorm.weight"], ref((H,), base=4000), "final norm")
        expect_equal(loaded["output_layer.weight"], cut(ref((3 * H, H), torch.bfloat16, base=-20), 0, t, T), "bf16")
    if rng:
        state = loaded["rng_state"]
        saved_rank = lay.pp_rank * saved_tp + t  # the saving rank of DP 0 that held this (pp, tp) shard
        if state["seed"] != 1234 + saved_rank or not torch.equal(state["state"], torch.arange(4) + saved_rank):
            raise AssertionError(f"rng_state: {state}")
    if flat_split is not None:
        n = 37
        bounds = flat_split(n, lay.dp)
        expect_equal(loaded["optimizer.flat"], ref((n,), base=100 * t)[bounds[lay.dp_rank]:bounds[lay.dp_rank + 1]],
                     "flat optimizer shard")
        if loaded["optimizer.param_groups"] != {"lr": 0.1, "tp": t}:
            raise AssertionError(f"param_groups: {loaded['optimizer.param_groups']}")
    if loaded["iteration"] != 100 or loaded["args"] != {"lr": 0.1, "name": "test"}:
        raise AssertionError(f"common values: {loaded['iteration']}, {loaded['args']}")


def even(n, parts):
    return [n * i // parts for i in range(parts + 1)]


def uneven(n, parts):
    b = [0] + [min(n, 5 + 11 * i) for i in range(1, parts)] + [n]
    return b


def fresh(d, name):
    path = os.path.join(d, name)
    if RANK == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def check_h5(path, lay):
    """h5py reads every dataset at its global shape (rank 0)."""
    if RANK != 0:
        return
    import h5py
    with h5py.File(os.path.join(path, scm.FILE_NAME), "r") as f:
        want = {"decoder.layers.mlp.linear_fc1.weight": ref((L, F, H), base=1000),
                "decoder.layers.mlp.linear_fc2.weight": ref((L, H, F), base=2000),
                "decoder.layers.input_layernorm.weight": ref((L, H), base=3000),
                "decoder.final_layernorm.weight": ref((H,), base=4000),
                "embedding.word_embeddings.weight": ref((padded_vocab(lay.tp), H), base=5000)}
        for key, full in want.items():
            expect_equal(torch.from_numpy(f[key][()]), full, f"h5py {key}")
        if f["output_layer.weight"].shape != (3 * H, H):
            raise AssertionError(f"h5py output_layer.weight shape {f['output_layer.weight'].shape}")


def case_model(d):
    """Saved by "shardckpt" at TP2 x DP2, loaded at TP4, TP1 x DP4, TP2 x PP2 and (with the flat
    optimizer shards split another way) TP2 x DP2; torch_dist saves and loads the same state dicts
    to the same values; the metadata matches torch_dist's."""
    save_lay = Layout(2)
    ours, theirs = fresh(d, "model.sc"), fresh(d, "model.td")
    dist_checkpointing.save(model_state(save_lay, flat_split=even), ours, sharded_strategy=BACKEND)
    dist_checkpointing.save(model_state(save_lay, flat_split=even), theirs)
    names = sorted(os.listdir(ours))
    if names != sorted(common_files() + ["metadata.json", scm.FILE_NAME]):
        raise AssertionError(f"checkpoint directory holds {names}")
    with open(os.path.join(ours, "metadata.json")) as f:
        if json.load(f)["sharded_backend"] != "shardckpt":
            raise AssertionError("metadata.json does not name the backend")
    check_h5(ours, save_lay)
    # The bool buffer is stored as uint8 bytes and recorded as every front end records it (and in the
    # backend's own older record), so that the state_dict and DCP front ends read it as bool too.
    common = sc.inspect(os.path.join(ours, scm.FILE_NAME))["common"]
    for name in ("shardckpt.dtypes", scm.DTYPES_KEY):
        if json.loads(common[name]) != {"decoder.mask": "bool"}:
            raise AssertionError(f"{name}: {common[name]}")
    from shardckpt.dcp import Reader
    meta = Reader(os.path.join(ours, scm.FILE_NAME)).read_metadata().state_dict_metadata
    if meta["decoder.mask"].properties.dtype != torch.bool:
        raise AssertionError(f"the DCP Reader reads the bool buffer as {meta['decoder.mask'].properties.dtype}")
    for lay, flat in ((Layout(4), None), (Layout(1), None), (Layout(2, pp=2), None), (Layout(2), uneven)):
        same = lay.tp == save_lay.tp and lay.pp == save_lay.pp
        for path in (ours, theirs):
            loaded = load(model_state(lay, fill=False, flat_split=flat, rng=same), path)
            try:
                check_model(lay, loaded, save_lay.tp, flat, rng=same)
            except AssertionError as e:
                raise AssertionError(f"{path} at TP {lay.tp} PP {lay.pp}: {e}") from None
    # What load_tensors_metadata and load_sharded_metadata return, as torch_dist's do.
    mine = dist_checkpointing.load_tensors_metadata(ours, *([scm.LoadStrategy()] if NEW else []))
    other = torch_dist_tensors_metadata(theirs)
    if set(mine) != set(other):
        raise AssertionError(f"tensor keys {sorted(mine)} != torch_dist's {sorted(other)}")
    for k in mine:
        if mine[k] != other[k]:
            raise AssertionError(f"{k}: {mine[k]} != torch_dist's {other[k]}")
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    objects = {k for k, v in load_sharded_metadata(ours, *([scm.LoadStrategy()] if NEW else [])).items()
               if isinstance(v, ShardedObject)}
    want = {f"rng_state/shard_0.{t}_1.2" for t in range(2)} | ({"common_state/shard_0_1"} if NEW else set())
    want |= {f"optimizer.distributed.dp_group_idx_{t}.param_groups/shard_0_1" for t in range(2)}
    td = {k for k, v in FileSystemReader(theirs).read_metadata().state_dict_metadata.items()
          if isinstance(v, BytesStorageMetadata)}
    if objects != want or td != want:
        raise AssertionError(f"sharded objects {sorted(objects)}, torch_dist's {sorted(td)}, want {sorted(want)}")


def torch_dist_tensors_metadata(path):
    """torch_dist's load_tensors_metadata, as Megatron 0.16 writes it, without the call that breaks on
    torch 2.15 (it passes TensorProperties' new fields to torch.empty)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    metadata = FileSystemReader(path).read_metadata()
    out = {}
    for k, tp in metadata.state_dict_metadata.items():
        if isinstance(tp, TensorStorageMetadata):
            out[k] = ShardedTensor.from_rank_offsets(k, torch.empty(tp.size, dtype=tp.properties.dtype,
                                                                    device="meta")).without_data()
    return out


def gtp_state(tp, gtp, align, fill=True):
    """This rank's GTP-sharded fused in_proj (GatedDeltaProduct) as a ShardedParam at TP x GTP over the
    world, through gtp_sharded_state_dict; its reference TP-local weight."""
    tp_rank, gtp_rank = RANK // gtp, RANK % gtp
    spec = spec_at(tp)
    param = sc.ShardedParam(spec, gtp=gtp, align=align, tp_rank=tp_rank, gtp_rank=gtp_rank)
    weight = reference(tp, tp_rank, dtype=torch.float32)
    shard = param.shard_of(weight) if fill else torch.zeros(param.padded_shape())
    param.shard = shard
    return param, shard, weight


def case_gtp(d):
    """GTP pieces saved as Megatron ShardedTensors by both backends at TP2 x GTP2, loaded at TP1 x GTP4
    (alignment 8) and TP4 x GTP1 into zeroed shards: filled in place, pad rows zero; the datasets are
    the native checkpoint's."""
    param, shard, _ = gtp_state(2, 2, 16)
    sd = scm.gtp_sharded_state_dict(param, prefix="decoder.layers.0.mixer.")
    for sh in sd.values():
        if sh.data.data_ptr() < shard.data_ptr() or sh.data.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr():
            raise AssertionError(f"{sh.key} is not a view of the shard")
    native = os.path.join(d, "gtp.native.h5")
    state = sc.StateDict()
    state.add(param)
    sc.save(state, native, sc.TorchGroup())
    for backend, name in ((BACKEND, "gtp.sc"), (None, "gtp.td")):
        path = fresh(d, name)
        dist_checkpointing.save(dict(sd), path, sharded_strategy=backend, validate_access_integrity=False)
        for tp, gtp, align in ((1, 4, 8), (4, 1, 16), (2, 2, 16)):
            p2, s2, weight = gtp_state(tp, gtp, align, fill=False)
            want = p2.shard_of(weight)
            load(scm.gtp_sharded_state_dict(p2, prefix="decoder.layers.0.mixer."), path)
            expect_equal(s2, want, f"{name}: shard at TP {tp} x GTP {gtp} (alignment {align})")
    if RANK == 0:
        import h5py
        with h5py.File(native) as n, h5py.File(os.path.join(d, "gtp.sc", scm.FILE_NAME)) as m:
            for key in n:
                if key.startswith("_"):
                    continue
                got = m["decoder.layers.0.mixer." + key]
                if got.shape != n[key].shape or not (got[()] == n[key][()]).all():
                    raise AssertionError(f"{key}: the backend's dataset differs from the native checkpoint's")


def expect_raised(what, kind, words):
    try:
        what()
    except kind as e:
        if not all(w in str(e) for w in words):
            raise AssertionError(f"{type(e).__name__} without {words}: {e}") from e
        return
    raise AssertionError(f"no {getattr(kind, '__name__', kind)} ({words})")


def case_bad(d):
    """Bad input fails on every rank, commits nothing."""
    lay = Layout(2)
    # Overlapping main replicas (regular grid, Megatron's validation off; and uneven pieces).
    for name, make in (("overlap", lambda: {"w": ShardedTensor.from_rank_offsets(
                            "w", torch.ones(4, 2), (0, lay.tp_rank, 2), replica_id=0)}),
                       ("overlap_uneven", lambda: {"w": ShardedTensor(
                            "w", torch.ones(3, 2), torch.float32, (3, 2), (9, 2), (2 * RANK, 0),
                            axis_fragmentations=None, replica_id=0)})):
        path = fresh(d, name)
        expect_raised(lambda: dist_checkpointing.save(make(), path, sharded_strategy=BACKEND,
                                                      validate_access_integrity=False),
                      CheckpointingException, ["w"])
        for f in ("metadata.json", scm.FILE_NAME):
            if os.path.exists(os.path.join(path, f)):
                raise AssertionError(f"{name}: {f} was written")
    # A gap: nobody writes rows 4..8.
    path = fresh(d, "gap")
    sd = {"w": ShardedTensor("w", torch.ones(2, 2), torch.float32, (2, 2), (8, 2), (2 * (RANK % 2), 0),
                             axis_fragmentations=None, replica_id=(0, RANK // 2))}
    expect_raised(lambda: dist_checkpointing.save(sd, path, sharded_strategy=BACKEND, validate_access_integrity=False),
                  CheckpointingException, ["w", "no rank"])
    # A dtype the library does not store, on one rank only.
    path = fresh(d, "fp8")
    dtype = torch.float8_e4m3fn if RANK == 1 else torch.float32
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2).to(dtype), (0, RANK, WORLD))}
    expect_raised(lambda: dist_checkpointing.save(sd, path, sharded_strategy=BACKEND, validate_access_integrity=False),
                  CheckpointingException, ["rank 1", "float8_e4m3fn"] if RANK != 1 else ["float8_e4m3fn"])
    # A ShardedObject that cannot be pickled, on rank 1 only: it fails in the second half of planning,
    # which the save's first exchange carries: every rank fails within seconds, nothing is written.
    path = fresh(d, "unpicklable")
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2), (0, RANK, WORLD)),
          "o": ShardedObject("o", (lambda: 0) if RANK == 1 else 0, (WORLD,), (RANK,), replica_id=0)}
    t0 = time.monotonic()
    expect_raised(lambda: dist_checkpointing.save(sd, path, sharded_strategy=BACKEND, validate_access_integrity=False),
                  (CheckpointingException, AttributeError, TypeError), ["rank 1"] if RANK != 1 else [])
    if time.monotonic() - t0 > 30 or os.path.exists(os.path.join(path, scm.FILE_NAME)):
        raise AssertionError(f"an unpicklable object on rank 1: {time.monotonic() - t0:.1f} s, or a file was written")
    # A good checkpoint, then loads that go wrong on one rank.
    path = fresh(d, "good")
    dist_checkpointing.save(model_state(lay), path, sharded_strategy=BACKEND)
    req = model_state(lay, fill=False)
    if RANK == 2:
        req["extra"] = ShardedTensor.from_rank_offsets("no.such.key", torch.zeros(2))
    expect_raised(lambda: load(req, path), CheckpointingException, ["no.such.key"])
    req = model_state(lay, fill=False)  # another global shape, on every rank (Megatron's check sees one)
    sh = req["decoder.final_layernorm.weight"]
    req["decoder.final_layernorm.weight"] = ShardedTensor.from_rank_offsets(sh.key, torch.zeros(H + 1),
                                                                            replica_id=sh.replica_id)
    expect_raised(lambda: load(req, path), CheckpointingException,
                  ["decoder.final_layernorm.weight", "mismatch"])
    # A checkpoint of another backend, named with ours: on 0.16 refused naming both backends; on 0.19
    # our LoadStrategy is a drop-in for torch_dist's (megatron/training builds it where it builds
    # that one) and torch_dist's code loads it.
    other = fresh(d, "other")
    dist_checkpointing.save(model_state(lay), other)
    if NEW:
        check_model(lay, dist_checkpointing.load(model_state(lay, fill=False), other, sharded_strategy=scm.LoadStrategy(
            cache_metadata=False, stream_ckpt_dequant=True)), 2)
    else:
        expect_raised(lambda: dist_checkpointing.load(model_state(lay, fill=False), other, sharded_strategy=BACKEND),
                      CheckpointingException, ["torch_dist"])
    # A changed byte is found by the checksums, on every rank.
    dist.barrier()
    if RANK == 0:
        import h5py
        with h5py.File(os.path.join(path, scm.FILE_NAME), "r") as f:
            offset = f["decoder.final_layernorm.weight"].id.get_offset()
        with open(os.path.join(path, scm.FILE_NAME), "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    expect_raised(lambda: load(model_state(lay, fill=False), path), CheckpointingException,
                  ["decoder.final_layernorm.weight"])


def case_found(d):
    """What Megatron's own dist_checkpointing tests found: parts with no elements are nobody's
    replicas (ranks 2 and 3 hold empty parts at one offset, each with replica_id 0); two keys load
    into views of one tensor (a factory builds three keys over its tensor), as torch_dist loads them;
    destinations that overlap at other rows are refused, naming both keys. Both backends alike."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    n = 30
    for save_split, load_split in (([0, 10, 30, 30, 30], [0, 0, 5, 25, 30]), ([0, 30, 30, 30, 30], [0, 7, 7, 30, 30])):
        for backend, name in ((BACKEND, "empty.sc"), (None, "empty.td")):
            path = fresh(d, f"{name}.{save_split[1]}")
            b, e = save_split[RANK], save_split[RANK + 1]
            full = ref((n,), base=7)
            sd = {"a": ShardedTensor("a", full[b:e].clone(), torch.float32, (e - b,), (n,), (b,),
                                     axis_fragmentations=None, replica_id=0)}
            dist_checkpointing.save(sd, path, sharded_strategy=backend, validate_access_integrity=False)
            b, e = load_split[RANK], load_split[RANK + 1]
            req = {"a": ShardedTensor("a", torch.zeros(e - b), torch.float32, (e - b,), (n,), (b,),
                                      axis_fragmentations=None, replica_id=0)}
            got = load(req, path, validate_access_integrity=False)
            expect_equal(got["a"], full[b:e], f"{name}: part [{b}, {e}) of a split {save_split}")
    # A tensor with no elements at all still gets its dataset, declared once.
    path = fresh(d, "empty.whole")
    dist_checkpointing.save({"z": ShardedTensor.from_rank_offsets("z", torch.zeros(0), replica_id=0)}, path,
                            sharded_strategy=BACKEND, validate_access_integrity=False)
    got = load({"z": ShardedTensor.from_rank_offsets("z", torch.zeros(0))}, path, validate_access_integrity=False)
    expect_equal(got["z"], torch.zeros(0), "a tensor without elements")

    def build(key, tensor, replica_id, flattened_range):
        return [ShardedTensor.from_rank_offsets(key + f"part{i}", tensor, replica_id=replica_id) for i in (1, 2, 3)]

    def state(base):
        return {"all": [ShardedTensor.from_rank_offsets("A", torch.arange(2) + base, replica_id=RANK),
                        ShardedTensorFactory("D", torch.arange(5) + base, build, sum, replica_id=RANK)]}

    for backend, name in ((BACKEND, "alias.sc"), (None, "alias.td")):
        path = fresh(d, name)
        dist_checkpointing.save(state(0), path, sharded_strategy=backend)
        got = load(state(10), path)
        expect_equal(got["all"][0], torch.arange(2), f"{name}: A")
        expect_equal(got["all"][1], 3 * torch.arange(5), f"{name}: D, the sum of its three keys")
    # Views that overlap at other rows: D1's rows 2..5 are D2's rows 0..3.
    path = os.path.join(d, "alias.sc")
    for dtype in (torch.int64, torch.float32):  # the checkpoint's dtype (filled in place), another (through copies)
        t = torch.zeros(6, dtype=dtype)
        req = {"x": ShardedTensor.from_rank_offsets("Dpart1", t[0:5]),
               "y": ShardedTensor.from_rank_offsets("Dpart2", t[1:6])}
        expect_raised(lambda: load(req, path, validate_access_integrity=False), CheckpointingException,
                      ["Dpart1", "Dpart2"])


class Secret:
    """A class no safe-globals list names: unpickling it runs code of the checkpoint's choosing."""

    def __init__(self, v):
        self.v = v


def case_guards(d):
    """The backend's own guards: a link planted at the backend's fixed file name is refused and its
    target untouched; ShardedObjects are unpickled with weights_only=True unless the caller says
    otherwise; on 0.19, a load with another strategy names ours, verify_integrity=True works and
    Megatron's fully parallel wrappers work around our strategies."""
    lay = Layout(2)
    path = fresh(d, "planted")
    victim = os.path.join(d, "victim.txt")
    if RANK == 0:
        with open(victim, "w") as f:
            f.write("keep me")
        os.symlink(victim, os.path.join(path, scm.FILE_NAME))
    dist.barrier()
    expect_raised(lambda: dist_checkpointing.save(model_state(lay), path, sharded_strategy=BACKEND),
                  CheckpointingException, [scm.FILE_NAME, "symbolic link"])
    with open(victim) as f:
        if f.read() != "keep me":
            raise AssertionError("the save wrote through the planted link")
    # A ShardedObject of a class outside the safe globals.
    path = fresh(d, "objects")
    sd = {"o": ShardedObject("o", Secret(RANK), (WORLD,), (RANK,), replica_id=0)}
    dist_checkpointing.save(sd, path, sharded_strategy=BACKEND)
    req = {"o": ShardedObject("o", None, (WORLD,), (RANK,), replica_id=0)}
    strict = scm.LoadStrategy()
    expect_raised(lambda: dist_checkpointing.load(req, path, sharded_strategy=strict if NEW else BACKEND),
                  CheckpointingException, ["ShardedObject o/shard_", "weights_only=False"])
    req = {"o": ShardedObject("o", None, (WORLD,), (RANK,), replica_id=0)}
    got = dist_checkpointing.load(req, path, sharded_strategy=scm.LoadStrategy(weights_only=False))
    if not isinstance(got["o"], Secret) or got["o"].v != RANK:
        raise AssertionError(f"weights_only=False: {got['o']!r}")
    # Ranks that opened different checkpoints (a save replaced the file between their opens: staged
    # here by rank 1 opening another directory's file) fail on every rank before any reads.
    one, other = fresh(d, "one"), fresh(d, "other")

    def rows(value):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), float(value)), (0, RANK, WORLD))}

    dist_checkpointing.save(rows(1), one, sharded_strategy=BACKEND)
    dist_checkpointing.save(rows(2), other, sharded_strategy=BACKEND)
    real = scm._path
    if RANK == 1:
        scm._path = lambda checkpoint_dir: real(other if os.fspath(checkpoint_dir) == one else checkpoint_dir)
    target = rows(-1)
    try:
        expect_raised(lambda: scm.LoadStrategy().load(target, one), CheckpointingException,
                      ["the ranks opened different checkpoints", "rank 1 checkpoint"])
    finally:
        scm._path = real
    if bool((target["w"].data != -1).any()):
        raise AssertionError("w was read although the ranks opened different checkpoints")
    scm.LoadStrategy().load(target, one)  # the control: every rank opens the same one
    expect_equal(target["w"].data, torch.full((4, 4), 1.0), "w of the control load")
    if not NEW:
        return
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                            FullyParallelSaveStrategyWrapper)
    path = fresh(d, "guarded")
    # Built as megatron/training builds torch_dist's strategies (its arguments change nothing here).
    dist_checkpointing.save(model_state(lay), path, sharded_strategy=scm.SaveStrategy(cpu_shm_mode=False),
                            verify_integrity=True)
    names = sorted(os.listdir(path))
    if not any("integrity" in n or "manifest" in n for n in names) or any(n.endswith(".distcp") for n in names):
        raise AssertionError(f"the directory holds {names}")
    for what, call in (("dist_checkpointing.load", lambda: dist_checkpointing.load(model_state(lay, fill=False), path)),
                       ("load_tensors_metadata", lambda: dist_checkpointing.load_tensors_metadata(path)),
                       ("load_sharded_metadata", lambda: dist_checkpointing.serialization.load_sharded_metadata(path))):
        expect_raised(call, CheckpointingException, [what, "shardckpt.megatron.LoadStrategy()"])
    check_model(lay, dist_checkpointing.load(model_state(lay, fill=False), path, sharded_strategy=scm.LoadStrategy(),
                                             verify_integrity=True), 2)
    # A byte changed after the save: Megatron's manifest check fails the load before ours reads.
    dist.barrier()
    if RANK == 0:
        with open(os.path.join(path, scm.FILE_NAME), "r+b") as f:
            f.seek(-1, 2)
            b = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    expect_raised(lambda: dist_checkpointing.load(model_state(lay, fill=False), path, sharded_strategy=scm.LoadStrategy(),
                                                  verify_integrity=True), CheckpointingException, [])
    # Megatron's fully parallel wrappers around our strategies.
    path = fresh(d, "parallel")
    dist_checkpointing.save(model_state(lay, flat_split=even), path,
                            sharded_strategy=FullyParallelSaveStrategyWrapper(scm.SaveStrategy(), backend=scm.BACKEND))
    with open(os.path.join(path, "metadata.json")) as f:
        if json.load(f)["sharded_backend"] != "shardckpt":
            raise AssertionError("metadata.json does not name the backend")
    for lay2, flat in ((Layout(2), even), (Layout(4), None)):
        got = dist_checkpointing.load(model_state(lay2, fill=False, flat_split=flat, rng=lay2.tp == 2), path,
                                      sharded_strategy=FullyParallelLoadStrategyWrapper(
                                          scm.LoadStrategy(), exchange_algo="gather_object"))  # broadcast: CUDA only
        check_model(lay2, got, 2, flat_split=flat, rng=lay2.tp == 2)


def versioned(v, fill=True):
    """A small state whose values say which save `v` wrote them."""
    w = (torch.arange(64, dtype=torch.float32).reshape(16, 4) + 1000 * v) if fill else torch.zeros(16, 4)
    return {"w": ShardedTensor.from_rank_offsets("w", w[RANK * 4:(RANK + 1) * 4].clone() if fill else torch.zeros(4, 4),
                                                 (0, RANK, WORLD)),
            "o": ShardedObject("o", {"v": v, "rank": RANK} if fill else None, (WORLD,), (RANK,), replica_id=0),
            "step": v}


def loaded_version(path):
    got = load(versioned(0, fill=False), path)
    v = got["step"]
    want = (torch.arange(64, dtype=torch.float32).reshape(16, 4) + 1000 * v)[RANK * 4:(RANK + 1) * 4]
    expect_equal(got["w"], want, f"w of save {v}")
    if got["o"] != {"v": v, "rank": RANK}:
        raise AssertionError(f"o of save {v}: {got['o']}")
    return v


def case_async(d):
    """0.19: async saves through Megatron's own AsyncCallsQueue (async_strategy "mcore", and "nvrx"
    where nvidia-resiliency-ext imports): the tensors may change once dist_checkpointing.save returns;
    metadata.json appears only at finalization; a load meanwhile gets the previous checkpoint or the
    new one whole; finalization makes the new one loadable; a save that fails fails on every rank."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    strategies = ["mcore"]
    try:
        import nvidia_resiliency_ext.checkpointing.async_ckpt.core as nvrx
        strategies.append("nvrx")
    except ImportError:
        nvrx = None
    for i, async_strategy in enumerate(strategies):
        # nvrx's persistent worker process picks a CUDA device (rank % device_count): none here, so
        # its forking caller, as Megatron's own queue uses by default.
        queue = nvrx.AsyncCallsQueue(persistent=False) if async_strategy == "nvrx" else AsyncCallsQueue()
        strategy = scm.SaveStrategy()
        fresh_path = fresh(d, f"async.fresh.{async_strategy}")
        path = fresh(d, f"async.{async_strategy}")
        dist_checkpointing.save(versioned(1), path, sharded_strategy=scm.SaveStrategy())
        last = {path: 1}
        for v, where in ((2, fresh_path), (3, path), (4, path)):
            sd = versioned(v)
            request = dist_checkpointing.save(sd, where, sharded_strategy=strategy, async_sharded_save=True,
                                              async_strategy=async_strategy)
            sd["w"].data.fill_(-1)  # staged: the save no longer reads the tensor
            if where == fresh_path and os.path.exists(os.path.join(where, "metadata.json")):
                raise AssertionError("metadata.json before finalization")
            queue.schedule_async_request(request)
            if where == path:  # the previous save or the new one, whole; or, racing its commit, refused
                for _ in range(3):
                    try:
                        seen = loaded_version(path)
                        break
                    except CheckpointingException as e:  # the common state's file, or another rank's, was older
                        if "replaced since it was opened" not in str(e):
                            raise
                else:
                    raise AssertionError("three loads in a row raced a commit")
                if seen not in (last[path], v):
                    raise AssertionError(f"during save {v}: save {seen} loaded")
            while not queue.maybe_finalize_async_calls(blocking=False):
                time.sleep(0.01)
            if loaded_version(where) != v:
                raise AssertionError(f"after finalization: not save {v}")
            last[where] = v
        # A save that cannot commit (a directory stands at the file's name) fails on every rank, at
        # dist_checkpointing.save or at finalization, and writes no metadata.json.
        gone = fresh(d, f"async.gone.{async_strategy}")
        if RANK == 0:
            os.mkdir(os.path.join(gone, scm.FILE_NAME))
        dist.barrier()

        def failing():
            request = dist_checkpointing.save(versioned(5), gone, sharded_strategy=strategy, async_sharded_save=True,
                                              async_strategy=async_strategy)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
        expect_raised(failing, CheckpointingException, ["async.gone", "directory"])
        if os.path.exists(os.path.join(gone, "metadata.json")):
            raise AssertionError("metadata.json of a failed save")
        queue.close()


def gpt(tp, seed):
    """Megatron's own GPTModel (its local layer spec, no Transformer Engine) at TP `tp` on CPU."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32)
    torch.manual_seed(seed)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8)


def case_gpt(d):
    """Megatron's GPTModel saved at TP2 x DP2 by both backends (its layer-stacked row-parallel weights
    split their last dim), loaded at TP2, TP4 and TP1: the "shardckpt" load gives every parameter
    what torch_dist's gives, and at TP2 the saved values."""
    model = gpt(2, seed=1)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    ours, theirs = fresh(d, "gpt.sc"), fresh(d, "gpt.td")
    dist_checkpointing.save(model.sharded_state_dict(), ours, sharded_strategy=BACKEND)
    dist_checkpointing.save(model.sharded_state_dict(), theirs)
    for tp in (2, 4, 1):
        got = {}
        for path in (ours, theirs):
            m = gpt(tp, seed=100 + tp)
            before = {k: v.detach().clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
            m.load_state_dict(load(m.sharded_state_dict(), path), strict=False)
            got[path] = {k: v.detach().clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
        # Biases and norms start as constants in both models; every matrix starts elsewhere.
        same = [k for k in before if before[k].dim() >= 2 and torch.equal(before[k], got[ours][k])]
        if same:
            raise AssertionError(f"TP {tp}: the load left {same} as initialized")
        for k in got[ours]:
            expect_equal(got[ours][k], got[theirs][k], f"TP {tp}: {k} (shardckpt against torch_dist)")
            if tp == 2:
                expect_equal(got[ours][k], saved[k], f"TP 2: {k} as saved")
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()


CASES = {"model": case_model, "gtp": case_gtp, "bad": case_bad, "gpt": case_gpt, "found": case_found,
         "guards": case_guards, "async": case_async}


def main():
    dist.init_process_group("gloo")
    run_cases(CASES, sys.argv[1], RANK)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
