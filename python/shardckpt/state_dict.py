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

This module only maps a tree to the library's StateDict and back: the entries, the dtypes (bool
tensors recorded in the common value "shardckpt.dtypes" too), the copies into targets and the votes
are the adapter's (_adapter.py), and every byte is saved and loaded by the library.
"""
import json

from . import _core
from ._adapter import (_AS_BYTES, TORCH_DTYPE_NAMES, Load, Tensors, as_bytes, collective, default_group, exchange,
                       open_checkpoint, recorded_dtypes, require_plain_bytes, stored_dtype, torch_dtype, vote,
                       write_dtypes)

__all__ = ["STRUCTURE_KEY", "TORCH_DTYPE_NAMES", "default_group", "exchange", "load_state_dict",
           "require_plain_bytes", "save_state_dict", "stored_dtype"]

# The common value that holds the tree of a state dict saved by save_state_dict (a JSON text).
STRUCTURE_KEY = "shardckpt.state_dict"
_FORMAT = 1

agree = vote  # the name this module gave it first


def _join(path):
    return ".".join(str(p) for p in path)


def _where(path):
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


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
            if as_bytes(name):
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
    tensors = Tensors(group)
    state, failure = _core.StateDict(), None
    try:
        structure, found, values = _flatten(state_dict, tensors)
        for key, value in found:
            for e in tensors.entries(key, value):
                state.add(e)
        for key, value in values.items():
            state.add_common(key, value)
        state.add_common(STRUCTURE_KEY, json.dumps({"format": _FORMAT, "tree": structure}, separators=(",", ":")))
        write_dtypes(state, {key: as_bytes(value.dtype) for key, value in found if as_bytes(value.dtype)})
    except Exception as e:  # noqa: BLE001 - any refusal (a DLPack error too) is voted on: no rank waits
        failure = e
    # A refusal on any rank fails every rank in the save's first exchange, before anything is written.
    collective(lambda refused: save(state, path, group, refused=refused, **options), group, failure)


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


def _structure(checkpoint):
    text = checkpoint.common.get(STRUCTURE_KEY)
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
        _check_tree(tree, checkpoint.common, checkpoint.datasets)
        return tree
    except (ValueError, KeyError, AttributeError, TypeError, RecursionError) as e:
        raise _core.Error(f"{checkpoint.path}: the common value {STRUCTURE_KEY!r} is not a state dict's structure "
                          f"written by this shardckpt ({type(e).__name__}: {str(e)[:200]})") from None


class _Loads:
    """The tensors of one collective load from `checkpoint`, each checked against its dataset and
    added to the adapter's Load (filled in place, or through a temporary copied back)."""

    def __init__(self, tensors, checkpoint):
        self.tensors, self.checkpoint = tensors, checkpoint
        self.recorded = recorded_dtypes(checkpoint)
        self.load = Load()

    def fill(self, key, target, recorded=None):
        """Tensor `target` of the state dict filled from dataset `key` (`recorded`: the dtype the tree
        records for it, if any)."""
        info = self.checkpoint.datasets.get(key)
        if info is None:
            raise KeyError(f"{self.checkpoint.path}: tensor {key} of the state dict is not in the checkpoint (no "
                           "dataset of that name)")
        shape = self.tensors.global_shape(target)
        if tuple(shape) != tuple(info["global_shape"]):
            raise ValueError(f"{self.checkpoint.path}: tensor {key} of the state dict has global shape "
                             f"{tuple(shape)}, the checkpoint's {tuple(info['global_shape'])}")
        self.tensors.dtype(target, key)
        self.load.parts(self.tensors, key, target, self.dtype(key, recorded), shape)

    def dtype(self, key, recorded=None):
        return torch_dtype(key, self.checkpoint.datasets[key], self.recorded, recorded)

    def new(self, key, node):
        """A tensor the checkpoint holds and the state dict does not: a new CPU tensor at its global shape."""
        import torch
        t = torch.empty(tuple(self.checkpoint.datasets[key]["global_shape"]), dtype=self.dtype(key, node.get("dtype")))
        self.fill(key, t, node.get("dtype"))
        return t


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
            loads.fill(key, given, node.get("dtype"))
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
    group = default_group(group)
    tensors = Tensors(group)
    loads, result, failure = None, None, None
    # One open of the file for the whole load, collective: its tree, common values and tensors are
    # one checkpoint's, and every rank's is the same one (or every rank fails, code "replaced").
    checkpoint = open_checkpoint(path, group)
    try:
        common = checkpoint.common
        loads = _Loads(tensors, checkpoint)
        structure = _structure(checkpoint)
        if structure is None:
            result = _fill_by_keys(state_dict, (), loads, common)
        else:
            missing = _given_only(structure, state_dict, (), tensors)
            if missing:
                raise KeyError(f"{checkpoint.path}: tensor {missing[0]} of the state dict is not in the checkpoint"
                               + (f" (nor are {len(missing) - 1} more)" if len(missing) > 1 else ""))
            result = _restore(structure, state_dict, (), loads, common)
    except Exception as e:  # noqa: BLE001 - any refusal is voted on: no rank waits on another's
        failure = e
    try:
        # The tensors from the file whose tree and common values were read above; a refusal on any
        # rank fails every rank in the load's first exchange, before anything is read.
        (loads.load if loads is not None else Load()).run(checkpoint, group, failure, **options)
    finally:
        checkpoint.close()
    return result
