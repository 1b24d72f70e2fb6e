"""One process of a gloo job under megatron-core 0.16 and torch 2.x (tests/megatron/test_megatron.py):
runs every case named on the command line against checkpoints in DIR and writes, for each, "ok" or
the failure's traceback to DIR/<case>.<rank>.json. Every rank builds the same reference tensors
(values from their indices), so each checks what it loads against the whole tensor without a
collective."""
import json
import os
import sys
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
BACKEND = ("shardckpt", 1)


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
    if names != ["common.pt", "metadata.json", scm.FILE_NAME]:
        raise AssertionError(f"checkpoint directory holds {names}")
    with open(os.path.join(ours, "metadata.json")) as f:
        if json.load(f)["sharded_backend"] != "shardckpt":
            raise AssertionError("metadata.json does not name the backend")
    check_h5(ours, save_lay)
    for lay, flat in ((Layout(4), None), (Layout(1), None), (Layout(2, pp=2), None), (Layout(2), uneven)):
        same = lay.tp == save_lay.tp and lay.pp == save_lay.pp
        for path in (ours, theirs):
            loaded = dist_checkpointing.load(model_state(lay, fill=False, flat_split=flat, rng=same), path)
            try:
                check_model(lay, loaded, save_lay.tp, flat, rng=same)
            except AssertionError as e:
                raise AssertionError(f"{path} at TP {lay.tp} PP {lay.pp}: {e}") from None
    # What load_tensors_metadata and load_sharded_metadata return, as torch_dist's do.
    mine = dist_checkpointing.load_tensors_metadata(ours)
    other = torch_dist_tensors_metadata(theirs)
    if set(mine) != set(other):
        raise AssertionError(f"tensor keys {sorted(mine)} != torch_dist's {sorted(other)}")
    for k in mine:
        if mine[k] != other[k]:
            raise AssertionError(f"{k}: {mine[k]} != torch_dist's {other[k]}")
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    objects = {k for k, v in load_sharded_metadata(ours).items() if isinstance(v, ShardedObject)}
    want = {f"rng_state/shard_0.{t}_1.2" for t in range(2)}
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
            dist_checkpointing.load(scm.gtp_sharded_state_dict(p2, prefix="decoder.layers.0.mixer."), path)
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
    raise AssertionError(f"no {kind.__name__} ({words})")


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
    # A good checkpoint, then loads that go wrong on one rank.
    path = fresh(d, "good")
    dist_checkpointing.save(model_state(lay), path, sharded_strategy=BACKEND)
    req = model_state(lay, fill=False)
    if RANK == 2:
        req["extra"] = ShardedTensor.from_rank_offsets("no.such.key", torch.zeros(2))
    expect_raised(lambda: dist_checkpointing.load(req, path), CheckpointingException, ["no.such.key"])
    req = model_state(lay, fill=False)  # another global shape, on every rank (Megatron's check sees one)
    sh = req["decoder.final_layernorm.weight"]
    req["decoder.final_layernorm.weight"] = ShardedTensor.from_rank_offsets(sh.key, torch.zeros(H + 1),
                                                                            replica_id=sh.replica_id)
    expect_raised(lambda: dist_checkpointing.load(req, path), CheckpointingException,
                  ["decoder.final_layernorm.weight", "mismatch"])
    # A checkpoint of another backend, named with ours.
    other = fresh(d, "other")
    dist_checkpointing.save(model_state(lay), other)
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
    expect_raised(lambda: dist_checkpointing.load(model_state(lay, fill=False), path), CheckpointingException,
                  ["decoder.final_layernorm.weight"])


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
            m.load_state_dict(dist_checkpointing.load(m.sharded_state_dict(), path), strict=False)
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


CASES = {"model": case_model, "gtp": case_gtp, "bad": case_bad, "gpt": case_gpt}


def main():
    dist.init_process_group("gloo")
    run_cases(CASES, sys.argv[1], RANK)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
