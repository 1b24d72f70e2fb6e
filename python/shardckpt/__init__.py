"""shardckpt: save and load GTP-sharded tensor-parallel weights as HDF5 checkpoints, without ever
gathering a full tensor. The Python face of the C++ library (docs/python.md): tensors come in place
through DLPack (torch, numpy, JAX, CuPy), torch.distributed is the process group (TorchGroup), and
every save and load is the library's own.
"""
import json
import os
import sys

# A library built with CUDA and NCCL links the system's libcudart.so.13 and libnccl.so.2; PyPI's torch
# 2.x brings its own, newer ones under the same sonames. Whichever is loaded first serves both, and
# torch's own code needs its own (an older libnccl lacks symbols it calls: "undefined symbol:
# ncclCommResume" when shardckpt was imported before torch). So torch, where it is installed, is
# loaded before the extension; shardckpt runs on torch's (newer, compatible) libraries.
try:
    import torch  # noqa: F401
except ImportError:
    pass

from . import _core
from ._core import (AsyncSave, Error, ParamSpec, Section, ShardedParam, ShardedTensor, SsmDims, StateDict,
                    TpDivisor, ssm_divisors,
                    gdp_conv1d_sections, gdp_in_proj_sections, mamba_conv1d_sections, mamba_in_proj_sections,
                    plain_sections)
from ._torch import TorchGroup
from ._shards import shard_of as _shard_of
from .state_dict import load_state_dict, save_state_dict

__version__ = _core.__version__
ShardedParam.shard_of = _shard_of
# (open is not in __all__: a star import would hide the builtin open.)
__all__ = ["AsyncSave", "Checkpoint", "Error", "ParamSpec", "Saver", "Section", "ShardedParam", "ShardedTensor", "SsmDims",
           "StateDict", "TorchGroup", "TpDivisor", "adopt", "gdp_conv1d_sections", "gdp_in_proj_sections", "inspect", "load",
           "load_into", "load_state_dict", "mamba_conv1d_sections", "mamba_in_proj_sections", "plain_sections", "read",
           "save", "save_state_dict", "ssm_divisors", "verify"]


def __getattr__(name):
    """shardckpt.dcp (torch.distributed.checkpoint's storage) and shardckpt.megatron (Megatron-core's
    backend) are imported when first named: they need torch 2.x (and megatron-core), which the rest
    of the package does not."""
    if name in ("dcp", "megatron"):
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'shardckpt' has no attribute {name!r}")


def _group(group):
    """None (this process alone), a TorchGroup, or a torch.distributed ProcessGroup."""
    if group is None or isinstance(group, TorchGroup):
        return group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(group, dist.ProcessGroup):
        return TorchGroup(group)
    return group  # any object with the group protocol; the library names a missing method


def _sync_cuda():
    """Device shards are read by the library's own CUDA stream: what torch queued must be done first."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _as_torch(loaded):
    """The library's tensors as torch tensors (no copy), values as they are."""
    import torch.utils.dlpack
    return {k: torch.utils.dlpack.from_dlpack(v) if isinstance(v, _core.Tensor) else v for k, v in loaded.items()}


def save(state, path, group=None, **options):
    """Saves every rank's `state` (a StateDict) as one checkpoint at `path` (collective).
    Options: method="raw"|"hyperslab", checksums=True, follow_links=True (False: a `path` that is a
    symbolic link is refused rather than its target replaced, for a file name fixed by the caller),
    refused="" (a reason this rank refuses its input: the save's first exchange fails every rank with
    it, code "invalid_argument" naming this rank, and nothing is written)."""
    _sync_cuda()
    _core.save(state, os.fspath(path), _group(group), **options)


def load_into(path, state, group=None, **options):
    """Fills the tensors of `state` in place at their layout (any TP, GTP, alignment) and returns the
    checkpoint's common values (and the state's local ones) as a dict. Options: method,
    verify_checksums=True, bypass_page_cache=False, expect_id="" (inspect's "checkpoint_id": a checkpoint
    another save put at `path` since is refused, code "replaced", so that what was inspected and
    what is loaded are one checkpoint), refused="" (as save's)."""
    _sync_cuda()
    values = _core.load_into(os.fspath(path), state, _group(group), **options)
    _sync_cuda()
    return values


def load(path, request, group=None, **options):
    """Loads the entries of `request` (a StateDict without data) into memory the library allocates:
    a dict from each tensor key to a torch tensor, and from each common value's key to its value.
    Options: method, verify_checksums=True, map=True (a tensor whose rows lie in the file as they
    would in memory is a private mapping of the file, every row checked: docs/python.md),
    expect_id="" and refused="" (as load_into's)."""
    return _as_torch(_core.load(os.fspath(path), request, _group(group), **options))


class Checkpoint:
    """A checkpoint held open (shardckpt.open): its id, its report (inspect) and loads that read from
    this one open file, so that a load's tree, common values and tensors come from one checkpoint
    whatever another save puts at the path meanwhile. A context manager; close() lets the file go (a
    mapped tensor keeps its pages)."""

    def __init__(self, core):
        self._core = core

    @property
    def path(self):
        return str(self._core.path)

    @property
    def checkpoint_id(self):
        return self._core.checkpoint_id

    @property
    def closed(self):
        return self._core.closed

    def inspect(self):
        """This checkpoint's tensors, parameter records, common values and id, as inspect(path) gives them."""
        return self._core.inspect()

    def load_into(self, state, group=None, **options):
        """load_into(path, state, group, ...) from this open file (collective over `group`: every rank's
        Checkpoint must hold the same checkpoint, or every rank fails with code "replaced")."""
        _sync_cuda()
        values = self._core.load_into(state, _group(group), **options)
        _sync_cuda()
        return values

    def load(self, request, group=None, **options):
        """load(path, request, group, ...) from this open file."""
        return _as_torch(self._core.load(request, _group(group), **options))

    def close(self):
        self._core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open(path, group=None):
    """Opens the checkpoint at `path` (collective over `group`: rank 0 checks its metadata's seal, the
    others that theirs has it; None: this process alone) and returns it as a Checkpoint, from which
    inspect() and loads read: one open file for the whole load."""
    return Checkpoint(_core.open(os.fspath(path), _group(group)))


def read(path, tp=1, tp_rank=0, map=True):
    """Every tensor of a checkpoint at TP degree `tp`, as TP rank `tp_rank` holds it, and its common
    values, in one dict (as load gives them): each parameter's TP-local weight (its fused blocks
    joined in row order; at tp=1 the plain weight) as a torch tensor, loaded by the library (every
    byte checked against its checksum), and each common value's key to its int, float or str.
    map=True: a tensor whose rows lie in the file as they lie in memory (a plain weight at tp=1, a
    tensor, an unpadded shard) is a private mapping of the file (writes to it never reach the file;
    the mapping lives as long as the last tensor over it); map=False: every tensor in memory of its
    own (docs/python.md, "Reads over the file")."""
    return _as_torch(_core.read(os.fspath(path), tp, tp_rank, map))


def adopt(source, out, specs, common=None):
    """Makes `source`, a safetensors file (Hugging Face's) or a plain HDF5 file (h5py's) holding the
    weights without TP, loadable as the checkpoint `out` (in the same directory) without copying its
    data, as `shardckpt adopt` does: `specs` are the parameters (ParamSpec, at any TP, or their
    record() dicts), whose fused tensors are cut into their blocks; `common` a dict of common values.
    Returns the counts {"tensors", "params", "fused", "bytes"}; raises shardckpt.Error as the CLI
    exits 2."""
    records = [s.record() if isinstance(s, ParamSpec) else s for s in specs]
    return _core.adopt(os.fspath(source), os.fspath(out), json.dumps(records), dict(common or {}))


def inspect(path):
    """The checkpoint's tensors, parameter records, common values and id, as a dict."""
    return _core.inspect(os.fspath(path))


def verify(path):
    """Checks every byte of the checkpoint against its checksum; returns the report, or raises
    shardckpt.Error: code "corrupt" naming the first rows that differ, "invalid_argument" for a
    checkpoint without checksums (nothing verified), as `shardckpt verify` exits 1 for both."""
    return _core.verify(os.fspath(path))


class Saver:
    """Repeated saves of one rank, and saves in the background (collective to make: every rank
    makes one). save_async plans this rank's pieces and returns: at once, before any byte is copied,
    when the rank's bytes exceed the saver's host budget (async_host_bytes, never less than the
    pool of 2 x staging_buffer_bytes) and lie in device memory; once the save has read them when they
    lie in host memory (Python code may free a host tensor's memory at any time: docs/python.md);
    after staging them all when they fit. The handle's wait_staged() returns once every byte has left
    the tensors (call it before the optimizer step changes them); wait() returns the collective
    outcome or raises it. check_unchanged=True hashes every row at save_async and again as it is
    staged: a tensor changed too early fails the save (shardckpt.Error, code "shard_changed", naming
    the key and rows). The budget (async_host_bytes, never less than the pool) is allocated and
    every page of it faulted in when the saver is made, so that no save_async waits for memory, the
    first included; reserve=False leaves that to reserve() (or to the first async save staged whole).
    close() ends the save in flight and frees the saver's memory; every saver still open is closed
    at interpreter exit, after its save in flight has ended."""

    _saver = None  # none in a Saver made by Saver.__new__ without __init__

    def __init__(self, group=None, cuda_device=None, async_host_bytes=0, check_unchanged=False,
                 staging_buffer_bytes=64 << 20, reserve=True, follow_links=True):
        self._saver = _core.Saver(_group(group), cuda_device, async_host_bytes, check_unchanged,
                                  staging_buffer_bytes, reserve, follow_links)

    def _core(self):
        if self._saver is None:
            raise TypeError("this Saver was made by Saver.__new__ without __init__: it holds no Saver")
        return self._saver

    def save(self, state, path):
        _sync_cuda()
        self._core().save(state, os.fspath(path))

    def save_async(self, state, path):
        _sync_cuda()  # the saver's copies may start at once: what torch queued must be done first
        return self._core().save_async(state, os.fspath(path))

    def close(self):
        self._core().close()

    def async_host_bytes(self):
        return self._core().async_host_bytes()

    def staging_bytes(self):
        """Pinned host memory this saver holds: its whole budget from the moment it is made (with
        reserve=False from reserve() or its first async save staged whole)."""
        return self._core().staging_bytes()

    def reserve(self):
        """Allocates the budget and faults in its pages if this saver does not hold it yet (made with
        reserve=False); this rank alone, not collective."""
        self._core().reserve()
