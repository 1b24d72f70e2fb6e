"""The one layer between the package's Python front ends (state_dict, dcp, megatron) and the
binding: what each of them hands the library and takes back from it, done one way.

- Entries: a torch tensor, a DTensor or a torch ShardedTensor as this rank's parts (Tensors), each
  part as a _core.ShardedTensor of the bytes the library takes (entry, stored).
- One dtype policy: the library stores bf16, f16, f32, f64 and 8- to 64-bit integers; bool is stored
  as uint8 bytes. Every save records the keys stored as another dtype's bytes in the common value
  DTYPES_KEY (write_dtypes), and every load reads a dataset's torch dtype through torch_dtype (that
  record, else a front end's older one, else the library's dtype).
- One copy-back policy (Load): a target contiguous in the stored dtype (bool: its uint8 view) is
  loaded in place on whatever device it is (CUDA memory through the library's device path); any
  other through a temporary of the stored dtype on the target's device, copied into it after the
  load, in the order the targets were added. Two keys into the same bytes: the second goes through
  a temporary; destinations that share only some bytes are refused (refuse_partial_overlaps).
- Objects as bytes: a bytes value as a 1-D uint8 dataset (bytes_entry), read back into a uint8
  buffer of the dataset's length (Load.bytes).
- Opening and voting: open_checkpoint (one checkpoint's contents, and loads from that same
  checkpoint), vote and exchange (every rank's failure raised on every rank before a collective).
"""
import json
import math
import re
import sys

from . import _core

# The common value that records the keys stored as another dtype's bytes: a JSON object
# {dataset key: torch dtype name}, written by every front end (always; "{}" when there are none).
DTYPES_KEY = "shardckpt.dtypes"

# torch dtypes the library stores (by torch's name), and those stored as the bytes of another one.
_STORED = {"bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
           "uint32", "uint64"}
_AS_BYTES = {"bool": "uint8"}
# torch's name of each dtype the library reports (inspect's "dtype").
TORCH_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "i8": "int8",
                     "i16": "int16", "i32": "int32", "i64": "int64", "u8": "uint8", "u16": "uint16", "u32": "uint32",
                     "u64": "uint64"}


def _torch():
    import torch
    return torch


def loaded_type(module, name):
    """Class `name` of torch module `module` when that module is loaded, else None: whoever holds a
    DTensor or a torch ShardedTensor has loaded its module, and importing it here could fail (torch
    1.13's sharded_tensor does not import on Python 3.11) or cost seconds for nothing."""
    return getattr(sys.modules.get(module), name, None)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# Voting and groups


def default_group(group):
    """The group a front end's call runs over: `group` as given (a TorchGroup or a torch.distributed
    ProcessGroup); else torch.distributed's default group when it is initialized; else None (this
    process alone)."""
    from . import _group
    if group is not None:
        return _group(group)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from ._torch import TorchGroup
        return TorchGroup()
    return None


def exchange(group, payload, failure, otherwise=RuntimeError):
    """Every rank's `payload` (JSON values), in rank order; or, when any rank's `failure` (None, or an
    exception raised before any byte moved) is one, that failure raised on every rank: the first
    failing rank's exception (its type where it is TypeError, ValueError or KeyError, else
    `otherwise`; its text naming the rank), so that no rank goes on into a collective the others
    never reach."""
    if group is None:
        if failure is not None:
            raise failure
        return [payload]
    told = None
    if failure is not None:
        told = [type(failure).__name__,
                failure.args[0] if isinstance(failure, KeyError) and failure.args else str(failure)]
    mine = json.dumps({"failure": told, "payload": payload}, separators=(",", ":")).encode()
    everyone = [json.loads(b) for b in group.all_gather_bytes(mine)]
    failed = [(r, e["failure"]) for r, e in enumerate(everyone) if e["failure"] is not None]
    if failed:
        if failure is not None and failed[0][0] == group.rank():
            raise failure
        rank, (name, message) = failed[0]
        kind = {"TypeError": TypeError, "ValueError": ValueError, "KeyError": KeyError}.get(name, otherwise)
        others = f" ({len(failed) - 1} other rank{'s' if len(failed) > 2 else ''} failed too)" if len(failed) > 1 else ""
        raise kind(f"rank {rank}: {message}{others}")
    return [e["payload"] for e in everyone]


def vote(group, failure, otherwise=RuntimeError):
    """exchange without a payload: every rank's `failure` raised on every rank."""
    exchange(group, None, failure, otherwise)


# A refusal as the library carries it across ranks (refused=): "[TypeError] the message".
_REFUSAL = re.compile(r"failed on (ranks? [0-9, -]+): \[([A-Za-z_][A-Za-z0-9_.]*)\] ")
_KINDS = {"TypeError": TypeError, "ValueError": ValueError, "KeyError": KeyError}


def _refusal(failure):
    message = failure.args[0] if isinstance(failure, KeyError) and failure.args else str(failure)
    return f"[{type(failure).__name__}] {message}"


def collective(call, group, failure, otherwise=RuntimeError):
    """Runs `call(refused)`, one collective call of the library over `group` (save, a load) that
    carries this rank's `failure` (None, or the exception its front end met before the call) into its
    first exchange: every rank then fails at once, nothing written or read, with no exchange of its
    own. This rank raises its own failure; another rank raises the first failing rank's (its type
    where it is TypeError, ValueError or KeyError, else `otherwise`; its text naming the rank); a
    failure of the library's own is the library's error."""
    if failure is not None and group is None:
        raise failure
    try:
        return call(_refusal(failure) if failure is not None else "")
    except _core.Error as e:
        if failure is not None:
            raise failure from None
        found = _REFUSAL.search(str(e))
        if found is None or e.code != "invalid_argument":
            raise
        rest = str(e)[found.end():]
        more = rest.find("; and on ")
        others = " (other ranks failed too)" if more >= 0 else ""
        if more >= 0:
            rest = rest[:more]
        raise _KINDS.get(found.group(2), otherwise)(f"{found.group(1)}: {rest}{others}") from None


# ----------------------------------------------------------------------------------------------
# Opening a checkpoint


class Checkpoint:
    """One checkpoint as a front end reads it, held open by the library (shardckpt.open): its path, its
    id, its common values (a dict) and its datasets ({key: inspect's tensor info}), all of this one
    open file, and load_into, which reads its tensors from that same file whatever another save puts
    at the path meanwhile. close() lets the file go."""

    def __init__(self, handle):
        self._handle = handle
        info = handle.inspect()
        self.path = handle.path
        self.checkpoint_id = info["checkpoint_id"]
        self.common = info["common"]
        self.datasets = {t["key"]: t for t in info["tensors"]}

    def load_into(self, state, group=None, refused="", **options):
        """Fills `state` (a _core.StateDict) from this checkpoint (collective over `group` when given: the
        ranks' checkpoints must be one, or every rank fails with code "replaced"); options as
        shardckpt.load_into's (method, verify_checksums, bypass_page_cache); `refused` as collective's."""
        return self._handle.load_into(state, group, refused=refused, **options)

    def close(self):
        self._handle.close()


def open_checkpoint(path, group=None):
    """The checkpoint at `path`, opened once (collective over `group` when given: rank 0 checks its
    metadata's seal, the others that theirs has it; every rank gets it or the same error)."""
    from . import open as open_held
    return Checkpoint(open_held(path, group))


# ----------------------------------------------------------------------------------------------
# Dtypes


def stored_dtype(dtype, key, error=TypeError, hint=""):
    """torch's name of `dtype` when the library stores it (itself or as the bytes of another);
    otherwise `error` naming `key` and the dtypes it stores (and `hint`)."""
    name = dtype_name(dtype)
    if name not in _STORED and name not in _AS_BYTES:
        raise error(f"{key}: a {name} tensor: shardckpt stores bfloat16, float16, float32, float64, bool and "
                    f"integer tensors of 8 to 64 bits{hint}")
    return name


def as_bytes(dtype):
    """torch's name of `dtype` (a torch dtype or its name) when the library stores it as another
    dtype's bytes (bool), else None: what a save records in DTYPES_KEY."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return name if name in _AS_BYTES else None


def write_dtypes(state, recorded):
    """Adds the common value DTYPES_KEY to `state`: `recorded`, {key: dtype name} of the keys stored
    as another dtype's bytes (every rank the same)."""
    state.add_common(DTYPES_KEY, json.dumps(dict(sorted(recorded.items())), separators=(",", ":")))


def recorded_dtypes(checkpoint, error=_core.Error):
    """The common value DTYPES_KEY of `checkpoint` ({key: dtype name}; {} when it has none), checked:
    a JSON object whose every value is a dtype stored as another's bytes, each naming a dataset of
    those bytes or none. Anything else is `error` naming the file and the common value."""
    text = checkpoint.common.get(DTYPES_KEY)
    if text is None:
        return {}
    try:
        if not isinstance(text, str):
            raise ValueError(f"a {type(text).__name__}, not a JSON text")
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError(f"a {type(doc).__name__}, not an object")
        for key, name in doc.items():
            if not isinstance(name, str) or name not in _AS_BYTES:
                raise ValueError(f"{key[:80]!r} recorded as {str(name)[:40]!r}, not a dtype stored as another's bytes")
            info = checkpoint.datasets.get(key)
            if info is not None and TORCH_DTYPE_NAMES.get(info["dtype"]) != _AS_BYTES[name]:
                raise ValueError(f"{key[:80]!r} recorded as {name}, a dataset of {info['dtype']}")
        return doc
    except (ValueError, TypeError, RecursionError) as e:
        raise error(f"{checkpoint.path}: the common value {DTYPES_KEY!r} is not what shardckpt writes "
                    f"({type(e).__name__}: {str(e)[:200]})") from None


def torch_dtype(key, info, recorded, fallback=None):
    """The torch dtype of dataset `key` (`info`: inspect's tensor info): the dtype `recorded`
    (recorded_dtypes) says, else `fallback` (a front end's older record: a state dict tree node's
    "dtype", Megatron's "megatron.dtypes"), else the library's dtype."""
    return getattr(_torch(), recorded.get(key) or fallback or TORCH_DTYPE_NAMES[info["dtype"]])


# ----------------------------------------------------------------------------------------------
# Entries


def require_plain_bytes(value, key, error=TypeError):
    """`error` naming `key` unless torch tensor `value` has plain bytes here to save or load into:
    dense (strided), not on the meta device."""
    torch = _torch()
    layout = getattr(value, "layout", torch.strided)
    if layout != torch.strided:
        raise error(f"{key}: a tensor of layout {layout}: shardckpt saves dense (strided) tensors; "
                    "convert it first (t.to_dense())")
    if getattr(getattr(value, "device", None), "type", None) == "meta":
        raise error(f"{key}: a tensor on the meta device has no bytes to save or to load into")


def stored(tensor):
    """A tensor's bytes as the library takes them: detached, contiguous, bool as uint8."""
    torch = _torch()
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t


def entry(key, tensor, global_shape, offset, replica_id=0, replicas=1):
    """A part of tensor `key` to save: `tensor` at `offset` of `global_shape`, as the library's entry
    (a TypeError naming `key` for a dtype the library does not store or a tensor without plain bytes)."""
    stored_dtype(tensor.dtype, key)
    require_plain_bytes(tensor, key)
    return _core.ShardedTensor(key, stored(tensor), list(global_shape), list(offset), replica_id, replicas)


def bytes_entry(key, raw):
    """Bytes `raw` to save as the 1-D uint8 dataset `key` (an object's pickle, DCP's bytes item)."""
    torch = _torch()
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    return _core.ShardedTensor(key, t, [len(raw)], [0])


class Tensors:
    """A front end's tensors (torch tensors, DTensors, torch ShardedTensors) as this rank's parts."""

    def __init__(self, group):
        self.rank = 0 if group is None else group.rank()
        self.size = 1 if group is None else group.size()
        self.dtensor = loaded_type("torch.distributed.tensor", "DTensor")
        self.sharded = loaded_type("torch.distributed._shard.sharded_tensor", "ShardedTensor")

    def kind(self, value):
        torch = _torch()
        if self.dtensor is not None and isinstance(value, self.dtensor):
            return "dtensor"
        if self.sharded is not None and isinstance(value, self.sharded):
            return "sharded"
        if isinstance(value, torch.Tensor):
            return "tensor"
        return None

    def global_shape(self, value):
        return list(value.shape if self.kind(value) != "sharded" else value.size())

    def dtype(self, value, key):
        """The stored dtype's name; a TypeError naming `key` for a tensor without plain bytes here (sparse,
        or on the meta device)."""
        name = stored_dtype(value.dtype, key)
        require_plain_bytes(value, key)
        return name

    def boxes(self, value, key):
        """This rank's parts of tensor `value` that hold elements (an uneven split leaves some ranks an
        empty one): (local tensor, global offset, replica_id, replicas)."""
        scalar = self.global_shape(value) == []
        return [b for b in self._parts(value, key) if scalar or b[0].numel() > 0]

    def entries(self, key, value):
        """This rank's entries to save of tensor `value`, named `key`. A tensor without elements (a
        dimension of size 0) has no part that holds any, and is declared once, so that its dataset
        exists at its shape: by rank 0 (a plain tensor, a torch ShardedTensor), or by the rank at the
        first coordinate of a DTensor's mesh."""
        shape = self.global_shape(value)
        boxes = self.boxes(value, key)
        if shape and math.prod(shape) == 0:
            kind = self.kind(value)
            first = (value.device_mesh.get_coordinate() == [0] * value.device_mesh.ndim if kind == "dtensor"
                     else self.rank == 0)
            local = value.to_local() if kind == "dtensor" else value if kind == "tensor" else None
            if local is None:
                torch = _torch()
                local = torch.empty(shape, dtype=value.dtype)
            boxes = [(local, [0] * len(shape), 0, 1)] if first else []
        return [entry(key, local, shape, offset, replica_id, replicas)
                for local, offset, replica_id, replicas in boxes]

    def _parts(self, value, key):
        kind = self.kind(value)
        if kind == "tensor":
            return [(value, [0] * value.dim(), self.rank, self.size)]
        if kind == "sharded":
            # Each local shard is a part of the tensor at its offset (a rank may hold several).
            return [(s.tensor, list(s.metadata.shard_offsets), 0, 1) for s in value.local_shards()]
        # A DTensor: its one local part at its global offset; the mesh dimensions it is replicated
        # over hold copies of it, written once between them.
        from torch.distributed.tensor import Replicate, Shard
        mesh, placements = value.device_mesh, value.placements
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the tensor's mesh
            return []
        replica_id, replicas = 0, 1
        for dim, p in enumerate(placements):
            if isinstance(p, Replicate):
                replica_id, replicas = replica_id * mesh.size(dim) + coordinate[dim], replicas * mesh.size(dim)
            elif not isinstance(p, Shard):
                raise ValueError(f"{key}: a DTensor placed {p} on mesh dim {dim}: shardckpt saves Shard and "
                                 "Replicate placements; redistribute it first (t.redistribute(placements=...))")
        chunks = value.__create_chunk_list__()
        local = value.to_local()
        return [(local, list(c.offsets), replica_id, replicas) for c in chunks]


# ----------------------------------------------------------------------------------------------
# Loads: the copy-back policy


def destination_key(t):
    """What identifies the bytes a destination covers, to find two destinations over the same bytes."""
    return (t.device.type, t.device.index, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def refuse_partial_overlaps(destinations, path, error=ValueError):
    """Destinations over the same bytes as another's (two keys into one view) load one after the
    other; contiguous destinations that share only some bytes would put two different rows in the
    same bytes: `error` naming both keys. `destinations`: {destination_key: (key, tensor)}."""
    spans = []
    for where, (key, t) in destinations.items():
        if t.is_contiguous() and t.numel() > 0:
            start = t.data_ptr()
            spans.append(((t.device.type, t.device.index), start, start + t.numel() * t.element_size(), key, where))
    spans.sort(key=lambda s: (s[0], s[1], s[2]))
    for (d1, s1, e1, k1, w1), (d2, s2, e2, k2, w2) in zip(spans, spans[1:]):
        if d1 == d2 and s2 < e1 and w1 != w2:
            raise error(f"{path}: the destinations of {k1} and {k2} share {min(e1, e2) - s2} bytes at other rows: "
                        "a load would put two different rows in the same bytes")


class BytesRead:
    """A bytes value a load reads: a 1-D uint8 buffer of the dataset's length; value() its bytes."""

    def __init__(self, key, length):
        torch = _torch()
        self.key = key
        self.buffer = torch.empty(length, dtype=torch.uint8)

    def value(self):
        return self.buffer.numpy().tobytes()


class Load:
    """The entries of one load of the library, under the one copy-back policy: a target contiguous in
    the stored dtype (bool: its uint8 view), on any device, is filled in place; any other through a
    temporary of the stored dtype on the target's device, copied into it by finish(), in the order
    they were added. A second key into the same bytes as another of this load goes through a
    temporary (the library refuses two destinations over one byte)."""

    def __init__(self):
        self.state = _core.StateDict()
        self.copy_back = []  # (target, temporary), in order
        self.destinations = {}  # destination_key: (key, target), the first key into those bytes

    def tensor(self, key, target, dtype, global_shape, offset):
        """Target `target` (a torch tensor) filled with the part of dataset `key` (of torch dtype `dtype`,
        at `global_shape`) at `offset`."""
        torch = _torch()
        target = target.detach()
        where = destination_key(target)
        if target.dtype == dtype and target.is_contiguous() and where not in self.destinations:
            into = target
        else:
            into = torch.empty(tuple(target.shape), dtype=dtype, device=target.device)
            self.copy_back.append((target, into))
        self.destinations.setdefault(where, (key, target))
        if into.dtype == torch.bool:
            into = into.view(torch.uint8)
        self.state.add(_core.ShardedTensor(key, into, list(global_shape), list(offset)))

    def parts(self, tensors, key, value, dtype, global_shape):
        """Each of this rank's parts of `value` (a Tensors kind) filled from dataset `key`."""
        for local, offset, _, _ in tensors.boxes(value, key):
            self.tensor(key, local, dtype, global_shape, offset)

    def bytes(self, key, length):
        """A BytesRead of the 1-D uint8 dataset `key` of `length` bytes."""
        read = BytesRead(key, length)
        self.state.add(_core.ShardedTensor(key, read.buffer, [length], [0]))
        return read

    def refuse_partial_overlaps(self, path, error=ValueError):
        refuse_partial_overlaps(self.destinations, path, error)

    def finish(self):
        """Copies every temporary into its target, in the order they were added."""
        for target, temp in self.copy_back:
            target.copy_(temp)

    def run(self, checkpoint, group=None, failure=None, otherwise=RuntimeError, **options):
        """Loads this load's entries from `checkpoint` (a Checkpoint) and copies the temporaries back;
        returns load_into's values. `failure`: this rank's refusal, voted on in the load's first
        exchange (collective)."""
        values = collective(lambda refused: checkpoint.load_into(self.state, group, refused, **options), group,
                            failure, otherwise)
        self.finish()
        return values
