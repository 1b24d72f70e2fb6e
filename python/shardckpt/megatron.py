"""shardckpt as a backend of Megatron-core's dist_checkpointing (megatron-core 0.16), and GTP pieces
as Megatron ShardedTensors.

    import shardckpt.megatron            # registers the backend "shardckpt", version 1
    from megatron.core import dist_checkpointing
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir, sharded_strategy=("shardckpt", 1))
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)   # the backend from metadata.json

Megatron writes its metadata.json and common.pt in `ckpt_dir` as it does for every backend; the
backend writes one checkpoint of the library's format, `ckpt_dir`/FILE_NAME (checksummed rows, sealed
metadata, atomic commit), in one collective save: every ShardedTensor key is a dataset at its global
shape, each rank writing the parts it holds at their global offsets (views of its tensors, no
gather), each part written once, its replicas taking turns (replica_id tuples: the ranks that hold
the same part share its writes). ShardedObjects are stored in it too, each the bytes torch.save makes
of it (a 1-D uint8 dataset; the common value OBJECTS_KEY maps dataset names to Megatron's unique
keys), as Megatron's own strategies pickle them. A load reads each rank's own parts (any TP, PP, DP
or distributed-optimizer split) into the tensors Megatron hands it, in place.

Errors are raised on every rank, as Megatron's CheckpointingException (a KeyError or TypeError where
Megatron's strategies raise one), before anything is committed. Megatron's own validation
(validate_access_integrity=True) runs on rank 0 alone before any strategy is called; this backend
checks overlaps and coverage itself, on every rank: see docs/megatron.md.
"""
import io
import json
import os
import zlib
from collections import defaultdict

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.base import (LoadShardedStrategy, SaveShardedStrategy,
                                                               StrategyAction, register_default_strategy)

from . import _core
from .state_dict import _AS_BYTES, TORCH_DTYPE_NAMES, _stored, default_group, exchange, stored_dtype

__all__ = ["BACKEND", "FILE_NAME", "OBJECTS_KEY", "VERSION", "LoadStrategy", "SaveStrategy", "gtp_sharded_state_dict"]

BACKEND = "shardckpt"
VERSION = 1
FILE_NAME = "shardckpt.h5"
OBJECTS_KEY = "megatron.objects"  # {dataset name: ShardedObject unique key}, a JSON text
DTYPES_KEY = "megatron.dtypes"  # {key: torch dtype} of tensors stored as another dtype's bytes (bool)
FORMAT_KEY = "megatron.format"


def _path(checkpoint_dir):
    return os.path.join(os.fspath(checkpoint_dir), FILE_NAME)


def _object_dataset(unique_key):
    return unique_key.replace("/", ".")


def _exchange(group, payload, failure):
    """state_dict.exchange, a failure that is no builtin raised on the other ranks as Megatron's
    CheckpointingException."""
    return exchange(group, payload, failure, otherwise=CheckpointingException)


def _collective(what):
    """Runs `what()` (a collective of the library): its failure, a shardckpt.Error the library raises
    on every rank, as Megatron's CheckpointingException."""
    try:
        return what()
    except _core.Error as e:
        raise CheckpointingException(str(e)) from e


def _view(sh, loading):
    """The tensor of ShardedTensor `sh` with its prepended axes (size 1) in front: a view, no copy."""
    if sh.flattened_range is not None:
        raise CheckpointingException(f"{sh.key}: a ShardedTensor with flattened_range: megatron-core 0.16 itself "
                                     "refuses them; give the flat shard as a 1-D ShardedTensor at its global offset")
    data = sh.data
    if data is None:
        if not loading:
            raise CheckpointingException(f"{sh.key}: a ShardedTensor without data to save")
        sh.init_data("cpu")
        data = sh.data
    for _ in range(sh.prepend_axis_num):
        data = data.unsqueeze(0)
    if tuple(data.shape) != tuple(1 for _ in range(sh.prepend_axis_num)) + tuple(sh.local_shape):
        raise CheckpointingException(f"{sh.key}: data of shape {tuple(sh.data.shape)}, local_shape {sh.local_shape}")
    return data


def _sharded(sharded_state_dict):
    tensors, objects = [], []
    for v in nested_values(sharded_state_dict):
        if isinstance(v, ShardedTensor):
            tensors.append(v)
        elif isinstance(v, ShardedObject):
            objects.append(v)
        else:
            raise CheckpointingException(f"a {type(v).__name__} in the sharded state dict handed to the shardckpt "
                                         "backend (Megatron hands it ShardedTensors and ShardedObjects)")
    return tensors, objects


def _writer_turn(key, offset, holders, rank):
    """(replica_id, replicas) of this rank's copy of a part the ranks `holders` hold: the replicas take
    turns part by part (the first writer of a part is picked by its key and offset), and the library
    splits each part's rows between them."""
    n = len(holders)
    first = zlib.crc32(json.dumps([key, offset]).encode()) % n
    return (holders.index(rank) - first) % n, n


class SaveStrategy(SaveShardedStrategy):
    """The "shardckpt" backend's save: one collective save of the library into ckpt_dir/FILE_NAME.
    `options`: shardckpt.save's (method="raw"|"hyperslab", checksums=True)."""

    def __init__(self, backend=BACKEND, version=VERSION, **options):
        super().__init__(backend, version)
        self._options = options

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir):
        from . import save
        group = default_group(None)
        rank = 0 if group is None else group.rank()
        parts, objects, failure = [], [], None
        mine = {"t": [], "o": [], "bytes_as": {}}
        try:
            tensors, sharded_objects = _sharded(sharded_state_dict)
            for sh in tensors:
                name = stored_dtype(sh.dtype, sh.key, CheckpointingException, " (dequantize FP8 first)")
                view = _view(sh, loading=False)
                if name in _AS_BYTES:
                    mine["bytes_as"][sh.key] = name
                entry = [sh.key, list(sh.global_offset), list(view.shape), bool(is_main_replica(sh.replica_id))]
                parts.append((entry, sh, view))
                mine["t"].append(entry)
            for obj in sharded_objects:
                main = bool(is_main_replica(obj.replica_id))
                mine["o"].append([obj.unique_key, main])
                if main:
                    objects.append(obj)
        except (CheckpointingException, TypeError, ValueError) as e:
            failure = e
        everyone = _exchange(group, mine, failure)

        # Who holds each part (key, offset, shape), and which of them hold it as its main replica.
        holders, mains = defaultdict(set), defaultdict(set)
        object_mains, bytes_as = defaultdict(set), {}
        for r, p in enumerate(everyone):
            for key, offset, shape, main in p["t"]:
                part = (key, tuple(offset), tuple(shape))
                holders[part].add(r)
                if main:
                    mains[part].add(r)
            for unique_key, main in p["o"]:
                if main:
                    object_mains[unique_key].add(r)
            bytes_as.update(p["bytes_as"])
        # Every rank finds the same faults in the same lists: the same error everywhere, nothing written.
        for (key, offset, shape), ranks in sorted(mains.items()):
            if len(ranks) > 1:
                raise CheckpointingException(
                    f"{key}: the part at offset {offset} of shape {shape} is a main replica on ranks "
                    f"{sorted(ranks)}: one of them must have replica_id 0 (the others' replica ids nonzero)")
        for unique_key, ranks in sorted(object_mains.items()):
            if len(ranks) > 1:
                raise CheckpointingException(f"ShardedObject {unique_key} is a main replica on ranks {sorted(ranks)}")

        state = _core.StateDict()
        failure = None
        try:
            seen = set()
            for (key, offset, shape, _), sh, view in parts:
                part = (key, tuple(offset), tuple(shape))
                if part in seen or not mains[part]:
                    continue  # held twice here (tied weights), or a replica of a part no main replica holds
                seen.add(part)
                replica_id, replicas = _writer_turn(key, offset, sorted(holders[part]), rank)
                state.add(_core.ShardedTensor(key, _stored(view), list(sh.global_shape), list(offset), replica_id,
                                              replicas))
            for obj in objects:
                buffer = io.BytesIO()
                torch.save(obj.data, buffer)
                raw = bytearray(buffer.getvalue())
                state.add(_core.ShardedTensor(_object_dataset(obj.unique_key), torch.frombuffer(raw, dtype=torch.uint8),
                                              [len(raw)], [0]))
            names = {_object_dataset(k): k for k in sorted(object_mains)}
            state.add_common(OBJECTS_KEY, json.dumps(names, sort_keys=True, separators=(",", ":")))
            state.add_common(DTYPES_KEY, json.dumps(bytes_as, sort_keys=True, separators=(",", ":")))
            state.add_common(FORMAT_KEY, VERSION)
        except (CheckpointingException, TypeError, ValueError, _core.Error) as e:
            failure = CheckpointingException(str(e)) if isinstance(e, _core.Error) else e
        _exchange(group, None, failure)
        _collective(lambda: save(state, _path(checkpoint_dir), group, **self._options))


class LoadStrategy(LoadShardedStrategy):
    """The "shardckpt" backend's load: each rank reads its own parts of ckpt_dir/FILE_NAME into the
    tensors Megatron hands it. `options`: shardckpt.load_into's (method, verify_checksums=True,
    bypass_page_cache=False)."""

    def __init__(self, **options):
        super().__init__()
        self._options = options

    @property
    def can_handle_sharded_objects(self):
        return True

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"the checkpoint was saved by the {loaded_backend!r} backend; the "
                                         f"shardckpt strategy loads {BACKEND!r} checkpoints (leave sharded_strategy "
                                         "unset: Megatron picks the strategy from metadata.json)")

    def check_version_compatibility(self, loaded_version):
        if loaded_version != VERSION:
            raise CheckpointingException(f"a {BACKEND!r} checkpoint of version {loaded_version}; this shardckpt "
                                         f"reads version {VERSION}")

    def _contents(self, checkpoint_dir):
        from . import inspect
        path = _path(checkpoint_dir)
        try:
            info = inspect(path)
            objects = json.loads(info["common"].get(OBJECTS_KEY, "{}"))
            bytes_as = json.loads(info["common"].get(DTYPES_KEY, "{}"))
        except _core.Error as e:
            raise CheckpointingException(str(e)) from e
        except ValueError as e:
            raise CheckpointingException(f"{path}: {OBJECTS_KEY!r} or {DTYPES_KEY!r} is not what the shardckpt "
                                         f"backend writes ({e})") from None
        datasets = {t["key"]: t for t in info["tensors"]}
        return path, datasets, objects, bytes_as

    def _dtype(self, key, info, bytes_as):
        return getattr(torch, bytes_as.get(key) or TORCH_DTYPE_NAMES[info["dtype"]])

    def load(self, sharded_state_dict, checkpoint_dir):
        from . import load_into
        group = default_group(None)
        state, copy_back, object_reads, failure = _core.StateDict(), [], [], None
        try:
            path, datasets, objects, bytes_as = self._contents(checkpoint_dir)
            by_unique_key = {k: name for name, k in objects.items()}
            tensors, sharded_objects = _sharded(sharded_state_dict)
            for sh in tensors:
                self._plan(sh, path, datasets, bytes_as, state, copy_back)
            for obj in sharded_objects:
                name = by_unique_key.get(obj.unique_key)
                if name is None or name not in datasets:
                    raise CheckpointingException(f"Object shard {obj.unique_key} not found in {path}")
                n = datasets[name]["global_shape"][0]
                buffer = torch.empty(n, dtype=torch.uint8)
                state.add(_core.ShardedTensor(name, buffer, [n], [0]))
                object_reads.append((obj, buffer))
        except (CheckpointingException, TypeError, ValueError, KeyError) as e:
            failure = e
        _exchange(group, None, failure)
        failure, loaded = None, {}
        try:
            load_into(path, state, None, **self._options)
            for target, temp in copy_back:
                target.copy_(temp)
            for obj, buffer in object_reads:  # unpickled before the last exchange: a bad one fails every rank
                try:
                    loaded[id(obj)] = torch.load(io.BytesIO(buffer.numpy().tobytes()), map_location="cpu",
                                                 weights_only=False)
                except Exception as e:  # noqa: BLE001 - whatever unpickling raises, said with the object's key
                    raise CheckpointingException(f"ShardedObject {obj.unique_key} in {path}: {e}") from e
        except _core.Error as e:
            failure = CheckpointingException(str(e))
        except CheckpointingException as e:
            failure = e
        _exchange(group, None, failure)
        return dict_list_map_inplace(lambda v: loaded[id(v)] if isinstance(v, ShardedObject) else v.data,
                                     sharded_state_dict)

    def _plan(self, sh, path, datasets, bytes_as, state, copy_back):
        """Adds ShardedTensor `sh`'s part to the load: into its tensor, or into a temporary of the
        stored dtype copied into it after the load. With allow_shape_mismatch (a padded vocabulary),
        the tensor is zeroed and the part of it the checkpoint holds is read (as torch_dist does)."""
        info = datasets.get(sh.key)
        if info is None:
            raise CheckpointingException(f"{path}: {sh.key} from the sharded state dict is not in the checkpoint")
        stored = tuple(info["global_shape"])
        view = _view(sh, loading=True)
        if sh.allow_shape_mismatch:  # as Megatron's torch_dist: what the checkpoint lacks is zero
            view.detach().zero_()
        if stored != tuple(sh.global_shape):
            if not sh.allow_shape_mismatch or len(stored) != len(sh.global_shape):
                raise CheckpointingException(f"Global shape mismatch for loaded ({stored}) and expected "
                                             f"({tuple(sh.global_shape)}) tensor for key {sh.key} ({path})")
            for d, (offset, stored_size) in enumerate(zip(sh.global_offset, stored)):
                view = view.narrow(d, 0, max(0, min(view.shape[d], stored_size - offset)))
            if view.numel() == 0:
                return
        dtype = self._dtype(sh.key, info, bytes_as)
        target = view.detach()
        if target.dtype == dtype and target.is_contiguous():
            into = target
        else:
            into = torch.empty(tuple(target.shape), dtype=dtype)
            copy_back.append((target, into))
        if into.dtype == torch.bool:
            into = into.view(torch.uint8)
        state.add(_core.ShardedTensor(sh.key, into, list(stored), list(sh.global_offset)))

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        """Each tensor's global shape and dtype, as Megatron's torch_dist strategy gives them: a
        ShardedTensor without data and without sharding per key (ShardedObjects left out)."""
        _, datasets, objects, bytes_as = self._contents(checkpoint_dir)
        out = {}
        for key, info in datasets.items():
            if key in objects:
                continue
            meta = torch.empty(tuple(info["global_shape"]), dtype=self._dtype(key, info, bytes_as), device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir):
        """load_tensors_metadata's tensors and each ShardedObject, keyed by its unique key, without data."""
        _, _, objects, _ = self._contents(checkpoint_dir)
        out = {}
        for unique_key in objects.values():
            obj = ShardedObject.empty_from_unique_key(unique_key)
            out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir))
        return out


def gtp_sharded_state_dict(param, prefix="", replica_id=None):
    """The GTP pieces of `param` (a shardckpt.ShardedParam holding its padded shard, a torch tensor) as
    Megatron ShardedTensors: {prefix + block key: ShardedTensor}, one per block this rank holds rows
    of (a fused weight's blocks are "<key>.<section>", the native checkpoint's dataset names), each a
    view of the shard's rows in that block (no copy; pad rows in none) at the block's global offset
    and global shape without GTP (a plain TP run's). Saved by any Megatron strategy, no full tensor is
    gathered. Loaded into a ZEROED shard, at any TP, GTP size or alignment, the shard is filled in
    place and its pad rows stay zero.

    The pieces are uneven, so they have axis_fragmentations=None: Megatron's own integrity check skips
    them (docs/megatron.md). `replica_id`: Megatron's, for every piece; by default (t, r): t = 0, or
    the TP rank for a weight TP replicates on TP ranks past 0, and r the ShardedParam's replica_id."""
    if param.flat is not None:
        raise ValueError(f"{param.key}: a ShardedParam with a flat range: give the whole padded shard")
    shard = param.shard
    if not isinstance(shard, torch.Tensor):
        raise TypeError(f"{param.key}: gtp_sharded_state_dict needs the ShardedParam's shard as a torch tensor, "
                        f"not {type(shard).__name__}")
    if tuple(shard.shape) != tuple(param.padded_shape()):
        raise ValueError(f"{param.key}: a shard of shape {tuple(shard.shape)}, its padded shape is "
                         f"{tuple(param.padded_shape())}")
    out = {}
    for piece in param.pieces():
        data = shard[piece["shard_row"]:piece["shard_row"] + piece["rows"]]
        rid = replica_id if replica_id is not None else (
            0 if piece["main_replica"] else param.tp_rank, param.replica_id)
        key = prefix + piece["key"]
        out[key] = ShardedTensor(key, data, data.dtype, tuple(piece["count"]), tuple(piece["global_shape"]),
                                 tuple(piece["global_offset"]), axis_fragmentations=None, replica_id=rid)
    return out


register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())
