"""GTP shards through Megatron-core's local (non-persistent) checkpoints: MCoreTensorAwareStateDict
(megatron/core/dist_checkpointing/tensor_aware_state_dict.py) with nvidia-resiliency-ext's local
checkpoint managers.

MCoreTensorAwareStateDict.to_state_dict(sharded_state_dict, ...) (megatron-core 0.19.2) builds the
factories of `sharded_state_dict`, takes their LocalNonpersistentObjects out into a tree of their own
and merges that tree into the result first; it then puts the loaded tensors into the sharded part
(the ShardedTensors and ShardedObjects only) and applies every factory's merge to that sharded part
alone, before merging it into the result. So a factory's merge never sees a LocalNonpersistentObject
its build gave, and a factory whose build gave no ShardedTensor at all has no entry in the sharded
part: apply_factory_merges raises "Different dict keys encountered in `apply_factory_merges`". With
shardckpt's GTP forms that means:

- gtp_sharded_state_dict(param) pieces round-trip as pieces: the result holds the loaded pieces (new
  tensors after a save to disk), not the shard; a padding-only rank (no pieces) gets nothing back for
  the parameter.
- no_gather(model)'s factory fails on every rank: its merge finds the pieces without the shard it
  keeps as a LocalNonpersistentObject ("the loaded state has no shard for no_gather's merge"), and on a
  padding-only rank, whose build gives only that object, Megatron raises "Different dict keys".

Two ways through, both here:

- gtp_shard_factory(param, prefix): a ShardedTensorFactory that survives Megatron's own order. Its
  build gives the pieces (views of the shard) or, on a padding-only rank, one zero-element placeholder
  ShardedTensor (it saves no byte) so that the parameter keeps its entry; its merge puts the loaded
  rows into the shard the load asked for (the tensor the factory held when it was built: the
  parameter, or an optimizer state Megatron substituted for it), zeroes the pad rows and gives it.
- to_state_dict(tasd, sharded_state_dict, **kwargs): MCoreTensorAwareStateDict.to_state_dict with the
  factory merges applied to the complete loaded tree (loaded tensors, common values and local
  non-persistent values together), as the library's state dicts merge: no_gather's factory and any
  other factory that keeps a LocalNonpersistentObject round-trip through it.

Nothing of the padding is saved either way: the pieces hold real rows only, and the local checkpoint
manager saves CPU copies of them (copy_tensors_to_cpu clones a view into a tensor of its own size).
"""
import weakref

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory, apply_factories,
                                                      apply_factory_merges)

try:
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict as _Tasd
    _MEGATRON_TO_STATE_DICT = _Tasd.to_state_dict
except ImportError:  # a megatron-core without local checkpoints
    _Tasd = _MEGATRON_TO_STATE_DICT = None

__all__ = ["gtp_shard_factory", "to_state_dict"]


def param_shard(param, who):
    """The shard of ShardedParam `param` as `who` takes it: a torch tensor of the padded shape, the whole
    shard (no flat range); a ValueError or TypeError naming the key otherwise."""
    if param.flat is not None:
        raise ValueError(f"{param.key}: a ShardedParam with a flat range: give the whole padded shard")
    shard = param.shard
    if not isinstance(shard, torch.Tensor):
        raise TypeError(f"{param.key}: {who} needs the ShardedParam's shard as a torch tensor, "
                        f"not {type(shard).__name__}")
    if tuple(shard.shape) != tuple(param.padded_shape()):
        raise ValueError(f"{param.key}: a shard of shape {tuple(shard.shape)}, its padded shape is "
                         f"{tuple(param.padded_shape())}")
    return shard


def to_state_dict(tasd, sharded_state_dict, **kwargs):
    """`tasd.to_state_dict(sharded_state_dict, **kwargs)` (an MCoreTensorAwareStateDict, as a local
    checkpoint manager's load() gives it; the same keyword arguments: algo, exchange_algo,
    validate_access_integrity, parallelization_group, strict, return_mismatch_keys), with every
    ShardedTensorFactory of `sharded_state_dict` merged against its complete loaded subtree: the
    loaded ShardedTensors and ShardedObjects, the common values and the LocalNonpersistentObjects its
    build gave, all merged into one tree first, and only then the factory merges, in place in that
    tree. Megatron's own method applies them to the sharded part alone, which loses what a factory
    keeps locally (no_gather's shard; see the module's docstring). Returns what Megatron's method
    returns: the state dict (and the mismatch keys with return_mismatch_keys=True).

    Its first parameter is the state dict, so it also serves as the method itself:
    MCoreTensorAwareStateDict.to_state_dict = shardckpt.megatron.to_state_dict makes Megatron's
    training loop (megatron/training/checkpointing.py) load local checkpoints this way.
    `sharded_state_dict` itself is not changed (its factories are built on a copy)."""
    if _MEGATRON_TO_STATE_DICT is None:
        raise ImportError("this megatron-core has no MCoreTensorAwareStateDict (local checkpoints)")
    if not sharded_state_dict:
        return _MEGATRON_TO_STATE_DICT(tasd, sharded_state_dict, **kwargs)
    built, _ = extract_matching_values(sharded_state_dict, lambda x: True)  # a copy of the containers
    factories, _ = extract_matching_values(built, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(built)
    dict_list_map_inplace(ShardedTensorFactory.without_data, factories)  # as Megatron: let the data go
    out = _MEGATRON_TO_STATE_DICT(tasd, built, **kwargs)
    if factories:
        state = out[0] if kwargs.get("return_mismatch_keys") else out
        apply_factory_merges(state, factories)
    return out


def gtp_shard_factory(param, prefix="", replica_id=None):
    """A Megatron ShardedTensorFactory for the padded GTP shard of `param` (a shardckpt.ShardedParam
    holding it, a torch tensor), at key `prefix + param.key`, that round-trips through Megatron's
    local checkpoints (MCoreTensorAwareStateDict.from_state_dict / to_state_dict, either algo) in
    Megatron's own merge order (and through this module's to_state_dict). Global checkpoints
    (dist_checkpointing.save/load) with it are not tested: use gtp_sharded_state_dict there.

    Its build gives, under the factory's key (the key Megatron gives it: a prefix it adds, or
    "optimizer.state.exp_avg." for an optimizer state built from it with the state in place of the
    shard), the pieces gtp_sharded_state_dict gives: for each block the rank holds real rows of, one
    ShardedTensor that is a view of those rows (no copy, pad rows in none), at the block's global
    offset and global shape without GTP (keys "<key>.<block>" for a fused weight). A padding-only rank
    (no real rows) gives instead one placeholder: a zero-element view of its shard under the last
    block's key, with the dtype and device of the shard and the block's global shape, at the end of
    this TP rank's rows of that block (no real piece starts there), a main replica on one rank per
    placement only. It saves no byte, and keeps the parameter's entry through Megatron's load
    preprocessing (without it, to_state_dict raises "Different dict keys encountered").

    Its merge gives the shard the load asked for: the tensor the factory held at the load's build
    (the parameter, or the optimizer state Megatron put in its place), on its own device and in its
    own dtype, its real rows from the loaded pieces (copied where the load did not read them in place)
    and its pad rows zero; a padding-only rank's comes back all zero. Should that tensor be gone, a new
    zeroed shard in the loaded pieces' dtype and on their device is filled and given.

    `replica_id`: Megatron's, for every piece; by default that of gtp_sharded_state_dict, (t, r): t = 0,
    or the TP rank for a weight TP replicates on TP ranks past 0, and r the ShardedParam's replica_id.
    Refused as in gtp_sharded_state_dict: a ShardedParam with a flat range, a shard that is not a torch
    tensor of the padded shape; and at build, a tensor of another shape or a flattened range."""
    shard = param_shard(param, "gtp_shard_factory")
    plan = _Plan(param)
    plan.check(param.key, shard)
    key = prefix + param.key
    return ShardedTensorFactory(key, shard, _Build(plan, replica_id), _Merge(plan),
                                replica_id if replica_id is not None else (0, param.replica_id))


class _Plan:
    """What a build and a merge need of a ShardedParam, without the ShardedParam (nor its shard): the
    shard's shape, its real rows, its pieces and the padding-only rank's placeholder."""

    def __init__(self, param):
        self.key = param.key
        self.shape = tuple(param.padded_shape())
        self.real = param.real_rows()
        self.pieces = [(p["key"][len(param.key):], p["shard_row"], p["rows"], tuple(p["count"]),
                        tuple(p["global_shape"]), tuple(p["global_offset"]),
                        (0 if p["main_replica"] else param.tp_rank, param.replica_id)) for p in param.pieces()]
        self.placeholder = None if self.pieces else self._placeholder(param)
        self.registry = {}  # the build's key -> a weak reference to the tensor it was built from

    @staticmethod
    def _placeholder(param):
        """(key suffix, local shape, global shape, global offset, replica_id) of a padding-only rank's
        zero-element piece: in the last block, at the end of this TP rank's rows of it, where no real
        piece starts. The GTP ranks with no real rows of one TP rank and replica share it, as do the TP
        ranks of a weight TP replicates: one of them is its main replica."""
        from . import ShardedParam
        whole = ShardedParam(param.spec, gtp=1, align=0, tp_rank=param.tp_rank, gtp_rank=0).pieces()[-1]
        offset = list(whole["global_offset"])
        offset[0] += whole["rows"]
        local = (0,) + tuple(whole["count"][1:])
        shard_rows = param.padded_shape()[0]
        first_empty = -(-param.spec.rows() // shard_rows)  # the first GTP rank without a real row
        replica = (param.gtp_rank - first_empty, 0 if whole["main_replica"] else param.tp_rank, param.replica_id)
        return whole["key"][len(param.key):], local, tuple(whole["global_shape"]), tuple(offset), replica

    def check(self, key, t):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != self.shape:
            what = f"a {type(t).__name__} of shape {tuple(getattr(t, 'shape', ()))}"
            raise ValueError(f"{key}: {what} for the GTP shard of {self.key}, of shape {self.shape}")


class _Build:
    """The factory's build_fn: {key: [ShardedTensor, ...]}, the pieces of `t` (or the placeholder);
    remembers `t` (weakly) under `key` for the merge."""

    def __init__(self, plan, replica_id):
        self.plan = plan
        self.replica_id = replica_id

    def __call__(self, key, t, replica_id, flattened_range):
        plan = self.plan
        if flattened_range is not None:
            raise ValueError(f"{key}: a flattened range {flattened_range} of a GTP shard: give the whole shard")
        plan.check(key, t)
        data = t.detach()
        out = []
        for suffix, row, rows, count, global_shape, global_offset, default_rid in plan.pieces:
            rid = default_rid if self.replica_id is None else replica_id
            out.append(ShardedTensor(key + suffix, data[row:row + rows], data.dtype, count, global_shape, global_offset,
                                     axis_fragmentations=None, replica_id=rid))
        if plan.placeholder is not None:
            suffix, local, global_shape, global_offset, rid = plan.placeholder
            out.append(ShardedTensor(key + suffix, data[:0], data.dtype, local, global_shape, global_offset,
                                     axis_fragmentations=None, replica_id=rid))
        plan.registry[key] = weakref.ref(t)
        return {key: out}


class _Merge:
    """The factory's merge_fn: the loaded pieces into the shard the build was given for the same key
    (or a new one), pad rows zeroed; gives that shard."""

    def __init__(self, plan):
        self.plan = plan

    @torch.no_grad()
    def __call__(self, loaded):
        plan = self.plan
        if not isinstance(loaded, dict) or len(loaded) != 1:
            raise ValueError(f"{plan.key}: the loaded state for a GTP shard is {type(loaded).__name__} "
                             f"{sorted(loaded) if isinstance(loaded, dict) else ''}, not the one entry its build gave")
        (key, got), = loaded.items()
        expected = len(plan.pieces) if plan.placeholder is None else 1
        if not isinstance(got, list) or len(got) != expected or not all(isinstance(g, torch.Tensor) for g in got):
            raise ValueError(f"{key}: {len(got) if isinstance(got, list) else type(got).__name__} loaded pieces, "
                             f"{expected} built")
        ref = plan.registry.get(key)
        t = ref() if ref is not None else None
        if t is None:
            t = torch.empty(plan.shape, dtype=got[0].dtype, device=got[0].device)
        data = t.detach()
        for (suffix, row, rows, *_), piece in zip(plan.pieces, got):
            target = data[row:row + rows]
            if tuple(piece.shape) != tuple(target.shape):
                raise ValueError(f"{key}{suffix}: a loaded piece of shape {tuple(piece.shape)} for shard rows "
                                 f"[{row}, {row + rows})")
            if piece.data_ptr() != target.data_ptr() or piece.dtype != target.dtype or piece.device != target.device:
                target.copy_(piece)
        data[plan.real:].zero_()
        return t
