"""save_state_dict and load_state_dict: any torch state dict (a module's, an optimizer's, nested
dicts and lists of them) in one call, each tensor one dataset at its global shape.

A tensor's dataset is named by its key path joined with "." as torch.distributed.checkpoint (DCP)
flattens it: state_dict["model"]["layer.weight"] is dataset "model.layer.weight", item 2 of a list
"...2". Plain tensors are replicas on every rank of the group (each writes a share of the rows);
a DTensor's local shard goes at its global offset (replicated mesh dimensions write it once); a
torch ShardedTensor's local shards at theirs. int, float, bool, str and None leaves are the
checkpoint's common values (named by their key paths, bools as ints), and one more common value,
STRUCTURE_KEY, records the tree (dict, list or tuple, each key's type, each leaf's type), so that a
load gives back what was saved. Anything else is a TypeError naming its key path, raised on every
rank before anything is written: nothing is pickled.

This module only maps a tree to the library's StateDict and back; every byte is saved and loaded by
the library (shardckpt.save, shardckpt.load_into).
"""
import json
import os
import sys

from . import _core

# The common value that holds the tree of a state dict saved by save_state_dict (a JSON text).
STRUCTURE_KEY = "shardckpt.state_dict"
_FORMAT = 1

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


def _loaded_type(module, name):
    """Class `name` of torch module `module` when that module is loaded, else None: whoever holds a
    DTensor or a torch ShardedTensor has loaded its module, and importing it here could fail (torch
    1.13's sharded_tensor does not import on Python 3.11) or cost seconds for nothing."""
    return getattr(sys.modules.get(module), name, None)


def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def stored_dtype(dtype, key, error=TypeError, hint=""):
    """torch's name of `dtype` when the library stores it (itself or as the bytes of another);
    otherwise `error` naming `key` and the dtypes it stores (and `hint`)."""
    name = _dtype_name(dtype)
    if name not in _STORED and name not in _AS_BYTES:
        raise error(f"{key}: a {name} tensor: shardckpt stores bfloat16, float16, float32, float64, bool and "
                    f"integer tensors of 8 to 64 bits{hint}")
    return name


def require_plain_bytes(value, key):
    """A TypeError naming `key` unless torch tensor `value` has plain bytes here to save or load into:
    dense (strided), not on the meta device."""
    torch = _torch()
    layout = getattr(value, "layout", torch.strided)
    if layout != torch.strided:
        raise TypeError(f"{key}: a tensor of layout {layout}: shardckpt saves dense (strided) tensors; "
                        "convert it first (t.to_dense())")
    if getattr(getattr(value, "device", None), "type", None) == "meta":
        raise TypeError(f"{key}: a tensor on the meta device has no bytes to save or to load into")


def default_group(group):
    """The group a state dict call runs over: `group` as given (a TorchGroup or a torch.distributed
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


def agree(group, failure):
    """exchange without a payload: every rank's `failure` raised on every rank."""
    exchange(group, None, failure)


def _join(path):
    return ".".join(str(p) for p in path)


def _where(path):
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


class _Tensors:
    """A tree's tensors, each as the library's entries: (key, tensor, entries kind)."""

    def __init__(self, group):
        self.rank = 0 if group is None else group.rank()
        self.size = 1 if group is None else group.size()
        self.dtensor = _loaded_type("torch.distributed.tensor", "DTensor")
        self.sharded = _loaded_type("torch.distributed._shard.sharded_tensor", "ShardedTensor")

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


def _stored(tensor):
    """A tensor's bytes as the library takes them: detached, contiguous, bool as uint8."""
    torch = _torch()
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t


def _flatten(state_dict, tensors):
    """(structure, tensors [(key, value)], values {key: common value}) of a state dict; a TypeError
    or ValueError names the key path of what cannot be saved."""
    from collections.abc import Mapping
    found, values, keys = [], {}, {}

    def claim(path):
        key = _join(path)
        if not key:
            raise ValueError("an empty key: a state dict's keys name datasets")
        if key in keys:
            raise ValueError(f"{_where(path)} and {_where(keys[key])} are both named {key!r} once their keys are "
                             "joined with '.': rename one")
        keys[key] = path
        return key

    def visit(value, path):
        if isinstance(value, Mapping):
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"{_where(path)}: a key of type {type(k).__name__} ({k!r}): a state dict's keys "
                                    "are str or int")
                items.append([k, visit(v, path + (k,))])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "tuple" if isinstance(value, tuple) else "list"
            return {kind: [visit(v, path + (i,)) for i, v in enumerate(value)]}
        if tensors.kind(value) is not None:
            key = claim(path)
            node = {"tensor": key}
            name = tensors.dtype(value, key)
            if name in _AS_BYTES:
                node["dtype"] = name
            found.append((key, value))
            return node
        if value is None:
            return {"none": None}
        if isinstance(value, bool):
            key = claim(path)
            values[key] = int(value)
            return {"bool": key}
        if isinstance(value, int):
            key = claim(path)
            if not -2**63 <= value < 2**63:
                raise ValueError(f"{key}: the int {value} is outside int64")
            values[key] = value
            return {"int": key}
        if isinstance(value, float):
            key = claim(path)
            values[key] = value
            return {"float": key}
        if isinstance(value, str):
            key = claim(path)
            values[key] = value
            return {"str": key}
        raise TypeError(f"{_join(path) or _where(path)}: a {type(value).__module__}.{type(value).__qualname__} "
                        "is not a state dict leaf: shardckpt saves tensors (DTensor and ShardedTensor too), int, "
                        "float, bool, str and None, in dicts, lists and tuples, and pickles nothing")

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict is a dict (a Mapping), not a {type(state_dict).__name__}")
    structure = visit(state_dict, ())
    return structure, found, values


def save_state_dict(state_dict, path, group=None, **options):
    """Saves `state_dict` (nested dicts, lists and tuples of tensors, DTensors, torch ShardedTensors
    and int, float, bool, str or None) as one checkpoint at `path`, collectively over `group` (None:
    torch.distributed's default group when it is initialized, else this process alone). Options as
    shardckpt.save (method, checksums)."""
    from . import save
    group = default_group(group)
    tensors = _Tensors(group)
    state, failure = _core.StateDict(), None
    try:
        structure, found, values = _flatten(state_dict, tensors)
        for key, value in found:
            shape = tensors.global_shape(value)
            for local, offset, replica_id, replicas in tensors.boxes(value, key):
                state.add(_core.ShardedTensor(key, _stored(local), shape, offset, replica_id, replicas))
        for key, value in values.items():
            state.add_common(key, value)
        state.add_common(STRUCTURE_KEY, json.dumps({"format": _FORMAT, "tree": structure}, separators=(",", ":")))
    except Exception as e:  # noqa: BLE001 - any refusal (a DLPack error too) is voted on: no rank waits
        failure = e
    agree(group, failure)
    save(state, path, group, **options)


# How deep a saved tree may nest: far beyond any state dict, far below Python's recursion limit.
_MAX_DEPTH = 200
_KINDS = {"bool", "int", "float", "str"}


def _check_tree(node, common, datasets, depth=0):
    """Raises ValueError unless `node` is a tree save_state_dict writes: dicts of [key, node] pairs,
    lists and tuples of nodes, tensors named by a dataset of the checkpoint (a dtype, if any, one the
    library stores as another's bytes), None, and leaves named by a common value of their type."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH}")
    if not isinstance(node, dict) or len(node) != 1 and not ("tensor" in node and set(node) <= {"tensor", "dtype"}):
        raise ValueError(f"a node that is {type(node).__name__}, not one of the tree's")
    if "dict" in node:
        items = node["dict"]
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], (str, int))
                                                  and not isinstance(i[0], bool) for i in items):
            raise ValueError("a dict node that is not a list of [key, node] pairs")
        for _, child in items:
            _check_tree(child, common, datasets, depth + 1)
    elif "list" in node or "tuple" in node:
        items = node.get("list", node.get("tuple"))
        if not isinstance(items, list):
            raise ValueError("a list node that is not a list")
        for child in items:
            _check_tree(child, common, datasets, depth + 1)
    elif "tensor" in node:
        if not isinstance(node["tensor"], str) or node["tensor"] not in datasets:
            raise ValueError(f"a tensor {str(node['tensor'])[:80]!r} the checkpoint has no dataset of")
        if "dtype" in node and node["dtype"] not in _AS_BYTES:
            raise ValueError(f"a tensor dtype {str(node['dtype'])[:40]!r}")
    elif "none" in node:
        pass
    else:
        kind, key = next(iter(node.items()))
        if kind not in _KINDS or not isinstance(key, str) or key not in common:
            raise ValueError(f"a leaf {str(kind)[:20]!r} whose common value {str(key)[:80]!r} is not in the checkpoint")
        value = common[key]
        expect = {"bool": int, "int": int, "float": (float, int), "str": str}[kind]
        if not isinstance(value, expect) or isinstance(value, bool):
            raise ValueError(f"a {kind} leaf whose common value {key!r} is a {type(value).__name__}")


def _structure(info, path):
    text = info["common"].get(STRUCTURE_KEY)
    if text is None:
        return None
    try:
        if not isinstance(text, str):
            raise ValueError(f"a {type(text).__name__}, not a JSON text")
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
            raise ValueError(f"format {doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}")
        tree = doc["tree"]
        if not isinstance(tree, dict) or "dict" not in tree:
            raise ValueError("its tree is not a dict")
        _check_tree(tree, info["common"], {t["key"] for t in info["tensors"]})
        return tree
    except (ValueError, KeyError, AttributeError, TypeError, RecursionError) as e:
        raise _core.Error(f"{os.fspath(path)}: the common value {STRUCTURE_KEY!r} is not a state dict's structure "
                          f"written by this shardckpt ({type(e).__name__}: {str(e)[:200]})") from None


class _Loads:
    """The entries of one collective load: tensors filled in place, and those filled through a
    temporary (non-contiguous, bool) copied back after the load."""

    def __init__(self, tensors, datasets, path):
        self.tensors, self.datasets, self.path = tensors, datasets, os.fspath(path)
        self.state = _core.StateDict()
        self.copy_back = []

    def fill(self, key, target):
        torch = _torch()
        info = self.datasets.get(key)
        if info is None:
            raise KeyError(f"{self.path}: tensor {key} of the state dict is not in the checkpoint (no dataset of "
                           "that name)")
        shape = self.tensors.global_shape(target)
        if tuple(shape) != tuple(info["global_shape"]):
            raise ValueError(f"{self.path}: tensor {key} of the state dict has global shape {tuple(shape)}, the "
                             f"checkpoint's {tuple(info['global_shape'])}")
        self.tensors.dtype(target, key)
        for local, offset, _, _ in self.tensors.boxes(target, key):
            into = local.detach()
            if not into.is_contiguous():  # filled through a contiguous copy, copied back by finish()
                into = torch.empty(local.shape, dtype=local.dtype, device=local.device)
                self.copy_back.append((local, into))
            self.state.add(_core.ShardedTensor(key, into.view(torch.uint8) if into.dtype == torch.bool else into,
                                               shape, offset))

    def new(self, key, node):
        """A tensor the checkpoint holds and the state dict does not: a new CPU tensor at its global shape."""
        torch = _torch()
        info = self.datasets[key]
        dtype = node.get("dtype") or TORCH_DTYPE_NAMES[info["dtype"]]
        t = torch.empty(tuple(info["global_shape"]), dtype=getattr(torch, dtype))
        self.fill(key, t)
        return t

    def finish(self):
        for local, temp in self.copy_back:
            local.detach().copy_(temp)


def _restore(node, given, path, loads, common):
    """The value of structure `node` at `path`, filling the tensors `given` holds there."""
    from collections.abc import Mapping
    if "dict" in node:
        out = given.__class__() if isinstance(given, dict) else {}
        for k, child in node["dict"]:
            g = given.get(k) if isinstance(given, Mapping) else None
            out[k] = _restore(child, g, path + (k,), loads, common)
        return out
    for kind, make in (("list", list), ("tuple", tuple)):
        if kind in node:
            items = given if isinstance(given, (list, tuple)) else ()
            return make(_restore(child, items[i] if i < len(items) else None, path + (i,), loads, common)
                        for i, child in enumerate(node[kind]))
    if "tensor" in node:
        key = node["tensor"]
        if loads.tensors.kind(given) is not None:
            loads.fill(key, given)
            return given
        return loads.new(key, node)
    if "none" in node:
        return None
    for kind, make in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if kind in node:
            return make(common[node[kind]])
    raise _core.Error(f"{_join(path)}: an unknown node in the checkpoint's state dict structure")


def _given_only(node, given, path, tensors):
    """The tensors of `given` the checkpoint's structure does not have: their key paths."""
    from collections.abc import Mapping
    missing = []
    if isinstance(given, Mapping):
        children = dict(node.get("dict", [])) if node else {}
        for k, v in given.items():
            missing += _given_only(children.get(k), v, path + (k,), tensors)
    elif isinstance(given, (list, tuple)):
        items = (node or {}).get("list", (node or {}).get("tuple", []))
        for i, v in enumerate(given):
            missing += _given_only(items[i] if i < len(items) else None, v, path + (i,), tensors)
    elif tensors.kind(given) is not None and (node is None or "tensor" not in node):
        missing.append(_join(path))
    return missing


def _fill_by_keys(given, path, loads, common):
    """A state dict without a saved structure (a DCP or native checkpoint): its tensors filled by key,
    its other leaves from the common values of the same key where the checkpoint has them."""
    from collections.abc import Mapping
    if isinstance(given, Mapping):
        out = given.__class__() if isinstance(given, dict) else {}
        for k, v in given.items():
            out[k] = _fill_by_keys(v, path + (k,), loads, common)
        return out
    if isinstance(given, (list, tuple)):
        return type(given)(_fill_by_keys(v, path + (i,), loads, common) for i, v in enumerate(given))
    if loads.tensors.kind(given) is not None:
        loads.fill(_join(path), given)
        return given
    key = _join(path)
    if key in common and isinstance(given, (bool, int, float, str)):
        return type(given)(common[key])
    return given


def load_state_dict(state_dict, path, group=None, **options):
    """Loads checkpoint `path` into `state_dict`: every tensor filled in place (a DTensor's local
    shard, at whatever mesh and placements it has now; a plain tensor whole), and returns the state
    dict as saved: the non-tensor leaves with their types (a tuple a tuple, a bool a bool), tensors
    the checkpoint has and `state_dict` lacks as new CPU tensors. Collective over `group` as
    save_state_dict. Options as shardckpt.load_into (method, verify_checksums, bypass_page_cache)."""
    from . import inspect, load_into
    group = default_group(group)
    tensors = _Tensors(group)
    loads, result, failure = None, None, None
    try:
        info = inspect(path)
        datasets = {t["key"]: t for t in info["tensors"]}
        common = info["common"]
        loads = _Loads(tensors, datasets, path)
        structure = _structure(info, path)
        if structure is None:
            result = _fill_by_keys(state_dict, (), loads, common)
        else:
            missing = _given_only(structure, state_dict, (), tensors)
            if missing:
                raise KeyError(f"{os.fspath(path)}: tensor {missing[0]} of the state dict is not in the checkpoint"
                               + (f" (nor are {len(missing) - 1} more)" if len(missing) > 1 else ""))
            result = _restore(structure, state_dict, (), loads, common)
    except Exception as e:  # noqa: BLE001 - any refusal is voted on: no rank waits on another's
        failure = e
    agree(group, failure)
    # The tensors from the file whose tree and common values were read above: a checkpoint another
    # save put at `path` since is refused (code "replaced"), never mixed in.
    load_into(path, loads.state, group, expect_id=info["checkpoint_id"], **options)
    loads.finish()
    return result
