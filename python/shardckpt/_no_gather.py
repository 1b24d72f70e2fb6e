"""no_gather(model): Megatron-core's MambaMixer checkpoints its GTP-sharded in_proj.weight as this
library's pieces instead of all-gathering it (megatron-core 0.19 and later; a no-op where nothing is
GTP-sharded).

Megatron-core 0.19's MambaMixer.sharded_state_dict all-gathers the GTP shards of in_proj.weight over
the GTP group into the whole TP-local weight on every GTP rank, cuts it into its blocks z, x, B, C and
dt, and on load pads and slices the merged TP-local weight back into the shard. It is the only module
of 0.19 that gathers a GTP-sharded weight for its checkpoint: conv1d (conv1d.weight/.bias, split into
x, B and C) is never GTP-sharded, and every other GTP weight is saved as its own shard by
make_tp_sharded_tensor_for_checkpoint, without a gather.

After no_gather(model), each mixer gives, for a GTP-sharded in_proj.weight, one
ShardedTensorFactory at the same key "<prefix>in_proj.weight", whose ShardedTensors are the library's
pieces (ShardedParam.pieces()): for each block a rank holds real rows of, one view of those rows of its
shard, at the block's global offset and with the block's global shape, under exactly the keys the same
mixer gives without GTP ("<prefix>in_proj.weight.z" ... ".dt"; "optimizer.state.exp_avg.<prefix>..."
for the optimizer state Megatron builds from it). Nothing is gathered and pad rows are in no piece. A
checkpoint so saved is one that the mixer without GTP saves, and loads at any TP, GTP size and
alignment (Megatron's own gathering load included); one saved without GTP, or by Megatron's own
gathering save (the same keys and shapes), loads here.

A load fills the shard in place: the pieces are views of it, which Megatron's torch_dist strategy
reads into in place (what a strategy hands back in other tensors is copied in by the merge). The
factory's merge then zeroes the shard's pad rows and gives the shard itself (the parameter, or the
optimizer's state tensor), so model.load_state_dict(loaded) and the optimizer's load_state_dict copy
it onto itself. A padding-only rank (no real rows) has no piece; the factory keeps its shard as a
LocalNonpersistentObject so that the merge still finds it, and gives it back zeroed. The TP-local
weight is never built, on save or on load.

Refused, as a CheckpointingException naming the key and the rank: a quantized (FP8) in_proj.weight, a
factory asked for a flattened range (the distributed optimizer's fully_sharded_model_space, which
megatron-core 0.19 refuses for every ShardedTensor), a tensor that is not the shard's shape, and a
shard whose geometry does not match the mixer (rows * GTP size != TP-local rows + pad_length).
"""
import dataclasses
import types

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory

__all__ = ["no_gather"]

_MARK = "__shardckpt_no_gather__"
_NAMES = ("z", "x", "B", "C", "dt")  # MambaMixer's in_proj blocks, in row order
# The attributes Megatron reads off a TP weight when it builds the weight's ShardedTensor; the stand-in
# (below) carries them, and none of the GTP ones.
_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "partition_sizes", "allreduce",
             "sequence_parallel", "shared")


def no_gather(model):
    """Changes every MambaMixer in `model` (a torch.nn.Module, or a list of them: Megatron's model
    chunks), in place, so that its sharded_state_dict() gives a GTP-sharded in_proj.weight as this
    library's pieces: views of the shard, no collective, pad rows in none, with the keys and global
    shapes of the same mixer without GTP (see the module's docstring). A mixer whose in_proj.weight is
    not GTP-sharded is saved as before. Calling it again changes nothing more. Returns `model`."""
    try:
        from megatron.core.ssm.mamba_mixer import MambaMixer
    except ImportError:  # a Megatron without Mamba (or without its dependencies) builds no MambaMixer
        return model
    for root in (model if isinstance(model, (list, tuple)) else [model]):
        for module in root.modules():
            if isinstance(module, MambaMixer) and not getattr(module.__dict__.get("sharded_state_dict"), _MARK, False):
                module.sharded_state_dict = types.MethodType(_mixer_sharded_state_dict, module)
    return model


def _rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _fail(key, what):
    return CheckpointingException(f"{key}: rank {_rank()}: {what}")


def _is_gtp_shard(weight):
    """As Megatron's is_gtp_param (and its gather's condition), without needing Transformer Engine."""
    return bool(getattr(weight, "is_gtp_weight_remat", False)) and getattr(weight, "gtp_remat_size", 1) > 1


def _is_quantized(weight):
    if getattr(weight, "_gtp_native_fp8", False):
        return True
    try:
        from megatron.core.fp8_utils import is_float8tensor
    except ImportError:
        return False
    return bool(is_float8tensor(weight))


def _mixer_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """MambaMixer.sharded_state_dict, its GTP-sharded in_proj.weight given as pieces of the shard."""
    original = type(self).sharded_state_dict
    weight = self.in_proj.weight
    if not _is_gtp_shard(weight):
        return original(self, prefix, sharded_offsets, metadata)
    key = f"{prefix}in_proj.weight"
    sizes = [self.d_inner_local_tp, self.d_inner_local_tp, self.ngroups_local_tp * self.d_state,
             self.ngroups_local_tp * self.d_state, self.nheads_local_tp]
    geometry = _Geometry.of(key, weight, sizes, self.pg_collection.tp)
    replicate_rank = _replicate_rank(self, weight)

    # Megatron's own method, with a stand-in of the TP-local shape on the meta device (no memory, no
    # GTP marks) in place of the shard: it takes the path of a mixer without GTP, so it gathers
    # nothing, and its factory for in_proj.weight says the keys, global shapes and offsets (sharded
    # offsets included) of that mixer's blocks.
    stand_in = torch.nn.Parameter(torch.empty((geometry.rows,) + tuple(weight.shape[1:]), dtype=weight.dtype,
                                              device="meta"), requires_grad=weight.requires_grad)
    for name in _TP_ATTRS:
        if hasattr(weight, name):
            setattr(stand_in, name, getattr(weight, name))
    params = self.in_proj._parameters
    params["weight"] = stand_in
    try:
        sharded = original(self, prefix, sharded_offsets, metadata)
    finally:
        params["weight"] = weight
    split = sharded.get(key)
    if not isinstance(split, ShardedTensorFactory):
        raise _fail(key, f"this Megatron's MambaMixer gives a {type(split).__name__} for it, not the factory that "
                         "splits it into z, x, B, C and dt: shardckpt.megatron.no_gather does not know this layout")
    replica_id = split.replica_id
    if isinstance(replica_id, tuple) and len(replica_id) == 3:
        # Megatron's DP coordinate counts the GTP peers, who hold other rows: replicas are the ranks of
        # the replicate group only (as Megatron's own GTP ShardedTensors say).
        replica_id = (*replica_id[:2], replicate_rank)
    elif replicate_rank != 0 or replica_id not in (0, (0,)):
        raise _fail(key, f"replica_id {replica_id!r}: expected Megatron's (PP, TP, DP) tuple")
    sharded[key] = ShardedTensorFactory(key, weight, _Builder(geometry, split.build_fn), _Merger(geometry),
                                        replica_id)
    return sharded


_mixer_sharded_state_dict.__dict__[_MARK] = True  # seen through the bound method (getattr)


def _replicate_rank(mixer, weight):
    """This rank's index among the ranks that hold the same shard: its rank in the data-parallel group
    without the GTP peers (Megatron's dp_cp), as Megatron's own GTP ShardedTensors use."""
    if weight.group.size() == torch.distributed.get_world_size():
        return 0
    group = getattr(mixer.pg_collection, "dp_cp", None)
    if group is not None:
        return group.rank()
    from megatron.core import parallel_state
    return parallel_state.get_data_parallel_rank(with_context_parallel=True, with_gtp_remat=False)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """A GTP shard of a TP-local fused weight: `rows` TP-local rows in blocks `sizes` (names _NAMES);
    the shard holds padded rows [gtp_rank * shard_rows, (gtp_rank + 1) * shard_rows), of which the first
    `real` are real; `pieces`: (block index, shard row, rows, row in the block) of each block they meet,
    the library's plan (shardckpt.ShardedParam.pieces())."""
    key: str
    rows: int
    shard_rows: int
    gtp: int
    gtp_rank: int
    tp: int
    tp_rank: int
    real: int
    sizes: tuple
    pieces: tuple

    @classmethod
    def of(cls, key, weight, sizes, tp_group):
        if _is_quantized(weight):
            raise _fail(key, f"a quantized (FP8) GTP shard ({type(weight).__name__}): no_gather saves views of the "
                             "shard, and this one's bytes are not its values (dequantize it, or leave this mixer "
                             "to Megatron's own save)")
        group = weight.group
        gtp, gtp_rank = group.size(), group.rank()
        rows, shard_rows = sum(sizes), weight.shape[0]
        pad = getattr(weight, "pad_length", 0)
        if gtp != weight.gtp_remat_size or weight.dim() < 2 or shard_rows * gtp != rows + pad:
            raise _fail(key, f"a GTP shard of {tuple(weight.shape)} at GTP {gtp} (gtp_remat_size "
                             f"{weight.gtp_remat_size}) with pad_length {pad}: the mixer's TP-local in_proj has "
                             f"{rows} rows ({dict(zip(_NAMES, sizes))})")
        pieces = cls._plan(key, weight, sizes, tp_group, gtp, gtp_rank, pad, shard_rows)
        real = max(0, min(rows - gtp_rank * shard_rows, shard_rows))
        return cls(key, rows, shard_rows, gtp, gtp_rank, tp_group.size(), tp_group.rank(), real, tuple(sizes),
                   pieces)

    @staticmethod
    def _plan(key, weight, sizes, tp_group, gtp, gtp_rank, pad, shard_rows):
        """The library's pieces of this shard, as (block index, shard row, rows, row in the block).
        Megatron's padding (gtp_remat_shard_dim0: pad_for_alignment * GTP size) is the library's with
        align = pad_for_alignment; the pieces depend only on the shard's rows, which an align of
        shard_rows (or 0 without padding) reproduces whatever pad_for_alignment made them."""
        from . import ParamSpec, Section, ShardedParam
        tp, tp_rank = tp_group.size(), tp_group.rank()
        spec = ParamSpec(key, [Section(n, s) for n, s in zip(_NAMES, sizes)], [int(d) for d in weight.shape[1:]],
                         tp=tp)
        param = ShardedParam(spec, gtp=gtp, align=shard_rows if pad else 0, tp_rank=tp_rank, gtp_rank=gtp_rank)
        if tuple(param.padded_shape()) != tuple(weight.shape):
            raise _fail(key, f"the library's shard is {tuple(param.padded_shape())}, Megatron's {tuple(weight.shape)}")
        out = []
        for piece in param.pieces():
            block = _NAMES.index(piece["key"][len(key) + 1:])
            row_in_block = piece["global_offset"][0] - tp_rank * sizes[block]
            out.append((block, piece["shard_row"], piece["rows"], row_in_block))
        return tuple(out)

    def check(self, key, t):
        if tuple(t.shape[:1]) != (self.shard_rows,):
            raise _fail(key, f"a tensor of shape {tuple(t.shape)} for the GTP shard of {self.shard_rows} rows "
                             f"(GTP rank {self.gtp_rank} of {self.gtp})")


class _Builder:
    """The factory's build_fn: the pieces of `t` (the shard, or an optimizer state of its shape) as
    ShardedTensors, each a view of its rows, made from the ShardedTensors Megatron's own split gives
    a mixer without GTP (keys, global shapes, sharded offsets). A padding-only rank gives none; every
    rank keeps `t` as a LocalNonpersistentObject for the merge (never saved)."""

    def __init__(self, geometry, split_build_fn):
        self.geometry = geometry
        self.split_build_fn = split_build_fn

    def __call__(self, key, t, replica_id, flattened_range):
        g = self.geometry
        if flattened_range is not None:
            raise _fail(key, f"a flattened range {flattened_range} of the GTP shard (the distributed optimizer's "
                             "fully_sharded_model_space, which megatron-core refuses for every ShardedTensor): "
                             "use another distrib_optim_sharding_type")
        g.check(key, t)
        stand_in = torch.empty((g.rows,) + tuple(t.shape[1:]), dtype=t.dtype, device="meta")
        blocks = self.split_build_fn(key, stand_in, replica_id, None)
        if [b.key for b in blocks] != [f"{key}.{n}" for n in _NAMES] or \
                [b.local_shape[0] for b in blocks] != list(g.sizes):
            raise _fail(key, f"Megatron splits it into {[(b.key, b.local_shape) for b in blocks]}, not the blocks "
                             f"{dict(zip(_NAMES, g.sizes))} no_gather plans")
        data = t.detach()
        pieces = []
        for block, shard_row, rows, row_in_block in g.pieces:
            b = blocks[block]
            axis = b.prepend_axis_num
            offset = list(b.global_offset)
            offset[axis] += row_in_block
            pieces.append(dataclasses.replace(
                b, data=data[shard_row:shard_row + rows], dtype=t.dtype, local_shape=(rows,) + tuple(b.local_shape[1:]),
                global_offset=tuple(offset), axis_fragmentations=None, replica_id=replica_id))
        out = {"shard": LocalNonpersistentObject(t)}
        if pieces:
            out["pieces"] = pieces
        return out


class _Merger:
    """The factory's merge_fn: the loaded pieces into the shard they were built from, where the load
    did not read them in place, its pad rows zeroed; gives that shard."""

    def __init__(self, geometry):
        self.geometry = geometry

    @torch.no_grad()
    def __call__(self, loaded):
        g = self.geometry
        if not isinstance(loaded, dict) or "shard" not in loaded:
            raise _fail(g.key, "the loaded state has no shard for no_gather's merge (was the sharded state dict "
                               "built by another mixer?)")
        t = loaded["shard"]
        got = loaded.get("pieces", [])
        if len(got) != len(g.pieces):
            raise _fail(g.key, f"{len(got)} loaded pieces, {len(g.pieces)} planned")
        g.check(g.key, t)
        data = t.detach()
        for (_, shard_row, rows, _), piece in zip(g.pieces, got):
            target = data[shard_row:shard_row + rows]
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != tuple(target.shape):
                raise _fail(g.key, f"a loaded piece {type(piece).__name__} {tuple(getattr(piece, 'shape', ()))} for "
                                   f"shard rows [{shard_row}, {shard_row + rows})")
            if piece.data_ptr() != target.data_ptr() or piece.dtype != target.dtype:
                target.copy_(piece)
        data[g.real:].zero_()
        return t
