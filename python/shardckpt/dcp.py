"""shardckpt as the storage of torch.distributed.checkpoint (DCP, torch 2.x).

    import torch.distributed.checkpoint as dcp
    from shardckpt.dcp import Writer, Reader
    dcp.save(state_dict, storage_writer=Writer("step100.h5"))
    dcp.load(state_dict, storage_reader=Reader("step100.h5"))

`path` is one HDF5 checkpoint of shardckpt's format (checksummed rows, sealed metadata, atomic
commit): each tensor of DCP's flattened state dict is a dataset at its global shape named by DCP's
key, each rank writing its own chunks at their offsets in its own dtype (bf16 included; bool as uint8
bytes, recorded in the common value "shardckpt.dtypes" and reported as bool again); DCP's bytes
items (the values DCP pickles with torch.save: an optimizer's param_groups, say) are 1-D uint8
datasets, listed in the common value BYTES_KEY. DCP's planner data (how its flat keys map back to the
nested state dict) is the common value PLANNER_DATA_KEY. The Reader reads such a checkpoint, a
native one (any dataset by its name: a fused parameter's blocks are datasets "<key>.<block>") and an
adopted safetensors one.

The Writer saves in write_data, where every rank of DCP's group calls it: one collective save of the
library over `group` (None: torch.distributed's default group when initialized), which should be the
group given to dcp.save / dcp.async_save. The Reader reads each rank's own requests, alone, from
the checkpoint its read_metadata opened, into DCP's tensors in place where they are contiguous in the
stored dtype (on any device), else through a temporary on the tensor's device. Entries, dtypes,
copies, bytes and votes are the package's adapter's (_adapter.py), as for the other front ends.
"""
import io
import json
import os

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _core
from ._adapter import (Load, as_bytes, bytes_entry, collective, default_group, entry, open_checkpoint, recorded_dtypes,
                       torch_dtype, write_dtypes)

__all__ = ["BYTES_KEY", "PLANNER_DATA_KEY", "Reader", "Writer"]

BYTES_KEY = "dcp.bytes"
PLANNER_DATA_KEY = "dcp.planner_data"


def _done(value):
    future = Future()
    future.set_result(value)
    return future


def _dtypes(item_lists):
    """{key: dtype name} of the tensors of these write items stored as another dtype's bytes (bool)."""
    out = {}
    for items in item_lists:
        for item in items:
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                name = as_bytes(item.tensor_data.properties.dtype)
                if name:
                    out[item.index.fqn] = name
    return out


class _Path:
    """The checkpoint a Writer or Reader names: given at construction, or by DCP's checkpoint_id."""

    def __init__(self, path, options):
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        self._options = options

    def reset(self, checkpoint_id=None):
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)


def _plain_path(path):
    if path is None:
        raise ValueError("shardckpt.dcp: no checkpoint path (give Writer(path) / Reader(path), or checkpoint_id=)")
    return os.fspath(path)


class Writer(_Path, StorageWriter):
    """A DCP StorageWriter that writes one shardckpt checkpoint at `path` (a file; it must not be a
    directory). `group`: the process group of the save (None: the default group when initialized).
    `options`: shardckpt.save's (method="raw"|"hyperslab", checksums=True)."""

    def __init__(self, path=None, group=None, **options):
        super().__init__(path, options)
        self._group = group

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        try:
            return not os.path.isdir(os.fspath(checkpoint_id))
        except TypeError:
            return False

    def storage_meta(self):
        return None

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self.is_coordinator = is_coordinator
        path = _plain_path(self.path)
        if os.path.isdir(path):  # DCP's own writers take a directory: say so before anything is planned
            raise IsADirectoryError(f"shardckpt.dcp.Writer: {path} is a directory; shardckpt writes one checkpoint "
                                    "file (give a file name, e.g. step100.h5)")

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        # The coordinator sees every rank's plan: which items are bytes, and DCP's key mapping, for
        # the common values rank 0 writes.
        byte_keys = sorted({item.index.fqn for p in plans for item in p.items if item.type == WriteItemType.BYTE_IO})
        mapping = {}
        for p in plans:
            if isinstance(p.planner_data, dict):
                mapping.update({k: list(v) for k, v in p.planner_data.items()})
        shared = {"bytes": byte_keys, "planner_data": mapping, "dtypes": _dtypes(p.items for p in plans)}
        from dataclasses import replace
        return [replace(p, storage_data=shared) for p in plans]

    def write_data(self, plan, planner):
        from . import save
        group = default_group(self._group)
        state, results, failure = _core.StateDict(), [], None
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                key = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue()
                    state.add(bytes_entry(key, raw))
                    size = len(raw)
                else:
                    state.add(entry(key, data, item.tensor_data.size, item.tensor_data.chunk.offsets))
                    size = data.numel() * data.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
            shared = plan.storage_data if isinstance(plan.storage_data, dict) else {
                "bytes": [], "planner_data": {}, "dtypes": _dtypes([plan.items])}
            state.add_common(BYTES_KEY, json.dumps(shared["bytes"], separators=(",", ":")))
            state.add_common(PLANNER_DATA_KEY, json.dumps(shared["planner_data"], separators=(",", ":")))
            write_dtypes(state, shared["dtypes"])
        except Exception as e:  # noqa: BLE001 - any refusal (a value DCP cannot pickle, say) is voted on
            failure = e
        # A refusal on any rank fails every rank in the save's first exchange, before anything is written.
        collective(lambda refused: save(state, _plain_path(self.path), group, refused=refused, **self._options),
                   group, failure)
        return _done(results)

    def finish(self, metadata, results):
        pass  # the library's save committed the checkpoint, sealed, in write_data


class Reader(_Path, StorageReader):
    """A DCP StorageReader of the shardckpt checkpoint at `path`: one written by Writer, a native
    shardckpt checkpoint or an adopted safetensors one. `options`: shardckpt.load_into's (method,
    verify_checksums=True, bypass_page_cache=False).

    DCP unpickles the bytes items a Reader hands it (torch.load with weights_only=False in its
    DefaultLoadPlanner): a checkpoint's bytes items run whatever code their author put in them.
    bytes_items=False refuses to hand any over (a shardckpt.Error naming the item and the file, before
    its bytes are read): for checkpoints you do not trust, whose state dicts hold tensors and plain
    values only."""

    def __init__(self, path=None, bytes_items=True, **options):
        super().__init__(path, options)
        self._bytes_items = bool(bytes_items)
        self._checkpoint = None  # the checkpoint read_metadata opened: read_data loads from it
        self._dtypes = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        try:
            with open(os.fspath(checkpoint_id), "rb") as f:
                return f.read(8) == b"\x89HDF\r\n\x1a\n"
        except (OSError, TypeError):
            return False

    @property
    def _id(self):
        """The checkpoint_id of the file read_metadata read."""
        return None if self._checkpoint is None else self._checkpoint.checkpoint_id

    def read_metadata(self, *args, **kwargs):
        path = _plain_path(self.path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"shardckpt.dcp.Reader: {path} is a directory, not a shardckpt checkpoint (a "
                                    "directory of .distcp files is read by DCP's FileSystemReader)")
        checkpoint = open_checkpoint(path)
        common = checkpoint.common
        try:
            byte_keys = json.loads(common.get(BYTES_KEY, "[]"))
            if not isinstance(byte_keys, list) or not all(isinstance(k, str) for k in byte_keys):
                raise ValueError(f"{BYTES_KEY} is not a list of keys")
            byte_keys = set(byte_keys)
            raw = json.loads(common.get(PLANNER_DATA_KEY, "{}"))
            if not isinstance(raw, dict) or not all(isinstance(v, list) and all(isinstance(p, (str, int)) for p in v)
                                                    for v in raw.values()):
                raise ValueError(f"{PLANNER_DATA_KEY} is not a map of key paths")
            planner_data = {k: tuple(v) for k, v in raw.items()}
        except (ValueError, AttributeError, TypeError, RecursionError) as e:
            raise _core.Error(f"{path}: the common value {BYTES_KEY!r} or {PLANNER_DATA_KEY!r} is not what "
                              f"shardckpt.dcp.Writer writes ({type(e).__name__}: {str(e)[:200]})") from None
        dtypes = recorded_dtypes(checkpoint)
        entries = {}
        for key, t in checkpoint.datasets.items():
            shape = tuple(t["global_shape"])
            if key in byte_keys:
                entries[key] = BytesStorageMetadata()
            else:
                size = torch.Size(shape)
                entries[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=torch_dtype(key, t, dtypes)), size=size,
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)])
        for k in list(planner_data):
            if k not in entries:
                del planner_data[k]
        self._checkpoint, self._dtypes = checkpoint, dtypes
        return Metadata(state_dict_metadata=entries, planner_data=planner_data or None)

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self.is_coordinator = is_coordinator
        if self._checkpoint is None:  # metadata read by another Reader object
            self.read_metadata()

    def prepare_local_plan(self, plan):
        # The checkpoint this rank's metadata came from, for the coordinator to compare.
        from dataclasses import replace
        return replace(plan, storage_data={"shardckpt.checkpoint_id": self._id, "path": self.path})

    def prepare_global_plan(self, plans):
        """Every rank must have read one checkpoint: a save that replaced the file between two ranks'
        read_metadata fails the load on every rank (DCP raises the coordinator's error everywhere)."""
        ids = [p.storage_data.get("shardckpt.checkpoint_id") if isinstance(p.storage_data, dict) else None
               for p in plans]
        if len(set(ids)) > 1:
            first = next(r for r, i in enumerate(ids) if i != ids[0])
            where = plans[first].storage_data.get("path") if isinstance(plans[first].storage_data, dict) else None
            raise _core.Error(f"{where or self.path}: the ranks read different checkpoints (rank 0 checkpoint "
                              f"{ids[0]}, rank {first} checkpoint {ids[first]}): another save replaced the file "
                              "during the load; nothing was loaded")
        return plans

    def read_data(self, plan, planner):
        checkpoint = self._checkpoint
        if checkpoint is None:
            self.read_metadata()
            checkpoint = self._checkpoint
        path = checkpoint.path
        # One load of the library per round, each key at most once in a round (a state dict of the
        # library holds a key once).
        rounds = []
        for req in plan.items:
            for r in rounds:
                if req.storage_index.fqn not in r:
                    r[req.storage_index.fqn] = req
                    break
            else:
                rounds.append({req.storage_index.fqn: req})
        for r in rounds:
            load, after = Load(), []
            for key, req in r.items():
                info = checkpoint.datasets.get(key)
                if info is None:
                    raise KeyError(f"{path}: no dataset {key!r}")
                shape = list(info["global_shape"])
                if req.type == LoadItemType.BYTE_IO:
                    if not self._bytes_items:
                        raise _core.Error(f"{path}: the bytes item {key!r} would be unpickled by DCP (weights_only="
                                          "False), and this Reader was made with bytes_items=False")
                    if len(shape) != 1:
                        raise _core.Error(f"{path}: the bytes item {key!r} is a dataset of shape {tuple(shape)}, not "
                                          "1-D bytes")
                    after.append((req, None, load.bytes(key, shape[0])))
                    continue
                # In place where it can be (any device), else through a temporary on its device.
                target = planner.resolve_tensor(req).detach()
                load.tensor(key, target, torch_dtype(key, info, self._dtypes), shape, list(req.storage_offsets))
                after.append((req, target, None))
            # From the file read_metadata opened (the one every rank agreed on in prepare_global_plan),
            # whatever another save has put at the path since.
            load.run(checkpoint, None, **self._options)
            for req, target, read in after:
                if target is None:
                    planner.load_bytes(req, io.BytesIO(read.value()))
                else:
                    planner.commit_tensor(req, target)
        return _done(None)
