"""shardckpt as a backend of Megatron-core's dist_checkpointing (megatron-core 0.19 and 0.16), and GTP
pieces as Megatron ShardedTensors.

    import shardckpt.megatron as scm
    from megatron.core import dist_checkpointing
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir, sharded_strategy=scm.SaveStrategy())
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir, sharded_strategy=scm.LoadStrategy())

On megatron-core 0.19 (0.18 removed the strategy registry) the strategies are objects: SaveStrategy
and LoadStrategy subclass Megatron's torch_dist strategies (dist_checkpointing.save replaces any
other save strategy by torch_dist's without a word) and override everything that touches storage:
nothing of torch_dist's writing or reading runs. On 0.16 the backend is registered as well, so
`sharded_strategy=("shardckpt", 1)` saves and a load without a strategy picks ours from
metadata.json.

Megatron writes its metadata.json in `ckpt_dir` as for every backend (on 0.16 its common.pt too);
the backend writes one checkpoint of the library's format, `ckpt_dir`/FILE_NAME (checksummed rows,
sealed metadata, atomic commit), in one collective save: every ShardedTensor key is a dataset at its
global shape, each rank writing the parts it holds at their global offsets (views of its tensors, no
gather), each part written once, its replicas taking turns. ShardedObjects (on 0.19 Megatron's common
state, the ShardedObject "common_state", among them) are stored in it too, each the bytes torch.save
makes of it (a 1-D uint8 dataset; the common value OBJECTS_KEY maps dataset names to Megatron's
unique keys). A load reads each rank's own parts (any TP, PP, DP or distributed-optimizer split)
into the tensors Megatron hands it, in place, from the one checkpoint whose objects it read, and
unpickles objects with weights_only=True and Megatron's safe globals (LoadStrategy(weights_only=False)
for a checkpoint whose pickles you trust and that needs more).

Importing this module on 0.19 also teaches Megatron's load_common_state_dict to read a shardckpt
directory's common state, and makes dist_checkpointing.load, load_tensors_metadata,
load_sharded_metadata and remove_sharded_tensors refuse a shardckpt directory with another strategy
(torch_dist's, the default), naming the strategy to pass.

Async saves (0.19): dist_checkpointing.save(..., sharded_strategy=SaveStrategy(),
async_sharded_save=True) returns Megatron's AsyncRequest (async_strategy="mcore", or "nvrx" with
nvidia-resiliency-ext), which Megatron's AsyncCallsQueue schedules and finalizes: the save runs in
the library's background thread (shardckpt.Saver), the caller blocking only until this rank's bytes
are staged; finalization raises the save's collective outcome on every rank before Megatron writes
metadata.json.

Errors are raised on every rank, as Megatron's CheckpointingException (a KeyError or TypeError where
Megatron's strategies raise one), before anything is committed; any exception a rank meets while it
plans its part of a save or load is voted on before the library's collectives, so no rank waits on
another's refusal. Megatron's own validation (validate_access_integrity=True) runs on rank 0 alone
before any strategy is called; this backend checks overlaps and coverage itself, on every rank: see
docs/megatron.md.
"""
import io
import json
import math
import os
import shutil
import tempfile
import threading
import time
import zlib
from collections import defaultdict

import torch
import megatron.core.dist_checkpointing as _dist_checkpointing
from megatron.core.dist_checkpointing import serialization as _serialization
from megatron.core.dist_checkpointing.core import CheckpointingException, maybe_load_config
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica

try:  # megatron-core up to 0.17: the strategy registry
    from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy as _LoadBase
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy as _SaveBase
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy
    REGISTRY = True
except ImportError:  # 0.18 and later: strategies are torch_dist's, or objects that subclass them
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy as _LoadBase
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy as _SaveBase
    REGISTRY = False

from . import _core
from ._local import gtp_shard_factory, param_shard, to_state_dict
from ._no_gather import no_gather
from ._adapter import (_AS_BYTES, Load, as_bytes, bytes_entry, collective, default_group, entry, exchange,
                       open_checkpoint, recorded_dtypes, require_plain_bytes, stored_dtype, torch_dtype, write_dtypes)

__all__ = ["BACKEND", "FILE_NAME", "OBJECTS_KEY", "VERSION", "LoadStrategy", "SaveStrategy", "gtp_shard_factory",
           "gtp_sharded_state_dict", "no_gather", "to_state_dict"]

BACKEND = "shardckpt"
VERSION = 1
FILE_NAME = "shardckpt.h5"
OBJECTS_KEY = "megatron.objects"  # {dataset name: ShardedObject unique key}, a JSON text
DTYPES_KEY = "megatron.dtypes"  # {key: torch dtype} of tensors stored as another dtype's bytes (bool); the
# adapter's "shardckpt.dtypes" holds the same, and is read first
FORMAT_KEY = "megatron.format"
COMMON_STATE = "common_state"  # the ShardedObject that holds Megatron's common state (0.18 and later)


def _path(checkpoint_dir):
    return os.path.join(os.fspath(checkpoint_dir), FILE_NAME)


def _object_dataset(unique_key):
    return unique_key.replace("/", ".")


def _as_checkpointing(e):
    """Exception `e` as Megatron raises it: CheckpointingException, KeyError and TypeError as they are,
    anything else a CheckpointingException with its type and text."""
    if isinstance(e, (CheckpointingException, KeyError, TypeError)):
        return e
    if isinstance(e, _core.Error):
        return CheckpointingException(str(e))
    return CheckpointingException(f"{type(e).__name__}: {e}")


def _exchange(group, payload, failure):
    """The adapter's exchange, a failure that is no builtin raised on the other ranks as Megatron's
    CheckpointingException."""
    return exchange(group, payload, failure if failure is None else _as_checkpointing(failure),
                    otherwise=CheckpointingException)


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
        raise CheckpointingException(f"{sh.key}: a ShardedTensor with flattened_range: megatron-core itself "
                                     "refuses them; give the flat shard as a 1-D ShardedTensor at its global offset")
    data = sh.data
    if data is None:
        if not loading:
            raise CheckpointingException(f"{sh.key}: a ShardedTensor without data to save")
        sh.init_data("cpu")
        data = sh.data
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{sh.key}: a ShardedTensor whose data is {type(data).__name__}, not a torch tensor")
    require_plain_bytes(data, sh.key)
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


def _plan_save(sharded_state_dict, group, vote_last=True):
    """This rank's StateDict of the library for a save of `sharded_state_dict`, the bytes it writes
    and its failure in making it (collective: every rank's parts are exchanged once, every rank's
    failure before that raised on every rank; with `vote_last`, a failure after it too, else it is
    returned for the save's first exchange to carry)."""
    rank = 0 if group is None else group.rank()
    parts, objects, failure = [], [], None
    mine = {"t": [], "o": [], "bytes_as": {}}
    try:
        tensors, sharded_objects = _sharded(sharded_state_dict)
        for sh in tensors:
            name = stored_dtype(sh.dtype, sh.key, CheckpointingException, " (dequantize FP8 first)")
            view = _view(sh, loading=False)
            if as_bytes(name):
                mine["bytes_as"][sh.key] = name
            listed = [sh.key, list(sh.global_offset), list(view.shape), bool(is_main_replica(sh.replica_id)),
                      list(sh.global_shape)]
            parts.append((listed, sh, view))
            mine["t"].append(listed)
        for obj in sharded_objects:
            main = bool(is_main_replica(obj.replica_id))
            mine["o"].append([obj.unique_key, main])
            if main:
                objects.append(obj)
    except Exception as e:  # noqa: BLE001 - any refusal is voted on, so no rank waits on another
        failure = e
    everyone = _exchange(group, mine, failure)

    # Who holds each part (key, offset, shape), and which of them hold it as its main replica. A part
    # without elements is nobody's replica: it writes nothing and clashes with nothing, except that
    # a tensor with no elements at all is declared once, by the lowest rank holding it.
    holders, mains = defaultdict(set), defaultdict(set)
    object_mains, bytes_as = defaultdict(set), {}
    for r, p in enumerate(everyone):
        for key, offset, shape, main, global_shape in p["t"]:
            part = (key, tuple(offset), tuple(shape))
            if math.prod(shape) == 0 and math.prod(global_shape) > 0:
                continue
            holders[part].add(r)
            if main or math.prod(global_shape) == 0:
                mains[part].add(r)
        for unique_key, main in p["o"]:
            if main:
                object_mains[unique_key].add(r)
        bytes_as.update(p["bytes_as"])
    # Every rank finds the same faults in the same lists: the same error everywhere, nothing written.
    for (key, offset, shape), ranks in sorted(mains.items()):
        if len(ranks) > 1 and math.prod(shape) > 0:
            raise CheckpointingException(
                f"{key}: the part at offset {offset} of shape {shape} is a main replica on ranks "
                f"{sorted(ranks)}: one of them must have replica_id 0 (the others' replica ids nonzero)")
    for unique_key, ranks in sorted(object_mains.items()):
        if len(ranks) > 1:
            raise CheckpointingException(f"ShardedObject {unique_key} is a main replica on ranks {sorted(ranks)}")

    state = _core.StateDict()
    failure, nbytes = None, 0
    try:
        seen = set()
        for (key, offset, shape, _, _), sh, view in parts:
            part = (key, tuple(offset), tuple(shape))
            if part in seen or not mains[part]:
                continue  # held twice here (tied weights), no elements, or a replica no main replica holds
            seen.add(part)
            if math.prod(shape) == 0:  # a tensor without elements: declared by the lowest rank alone
                if rank != min(mains[part]):
                    continue
                replica_id, replicas = 0, 1
            else:
                replica_id, replicas = _writer_turn(key, offset, sorted(holders[part]), rank)
            nbytes += view.numel() * view.element_size()
            state.add(entry(key, view, sh.global_shape, offset, replica_id, replicas))
        for obj in objects:
            buffer = io.BytesIO()
            torch.save(obj.data, buffer)
            raw = buffer.getvalue()
            nbytes += len(raw)
            state.add(bytes_entry(_object_dataset(obj.unique_key), raw))
        names = {_object_dataset(k): k for k in sorted(object_mains)}
        state.add_common(OBJECTS_KEY, json.dumps(names, sort_keys=True, separators=(",", ":")))
        # The keys some rank writes (a key whose every part is nobody's main replica has no dataset).
        written = {key for (key, _, _), ranks in mains.items() if ranks}
        write_dtypes(state, {k: v for k, v in bytes_as.items() if k in written})
        state.add_common(DTYPES_KEY, json.dumps(bytes_as, sort_keys=True, separators=(",", ":")))  # older readers
        state.add_common(FORMAT_KEY, VERSION)
    except Exception as e:  # noqa: BLE001 - voted on, as above
        failure = e
    if vote_last:
        _exchange(group, None, failure)
        failure = None
    return state, nbytes, failure


def _wait_for_commit(marker, parent):
    """The async process's work (Megatron's AsyncCallsQueue runs it in a process of its own, forked or
    persistent): wait until the trainer's background save has ended (its watcher makes `marker`),
    so that the queue sees this rank's save as running until then. Gives up when the trainer is gone
    (this process then has another parent: a trainer that exited is a zombie until reaped, and the
    process that would reap it may be waiting for this one's output to end)."""
    while not os.path.exists(marker):
        if os.getppid() != parent:
            return
        time.sleep(0.005)


class _Pending:
    """One async save in flight: a watcher thread (not a daemon: the interpreter lets it end before it
    exits) waits for the library's outcome and then makes the marker the async process waits for."""

    def __init__(self, handle, path):
        self.handle, self.path = handle, path
        self.dir = tempfile.mkdtemp(prefix="shardckpt-async-")
        self.marker = os.path.join(self.dir, "done")
        self.failure = None
        self.thread = threading.Thread(target=self._watch, name="shardckpt-megatron-async")
        self.thread.start()

    def _watch(self):
        try:
            self.handle.wait()
        except BaseException as e:  # noqa: BLE001 - kept for finalize, raised there on every rank
            self.failure = e
        finally:
            with open(self.marker, "x"):
                pass

    def finalize(self):
        """Megatron's finalization of the request (every rank, once every rank's async process ended):
        the save's collective outcome, raised on every rank before metadata.json is written."""
        self.thread.join()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.failure is not None:
            raise _as_checkpointing(self.failure) from self.failure


class SaveStrategy(_SaveBase):
    """The "shardckpt" backend's save: one collective save of the library into ckpt_dir/FILE_NAME.
    `options`: shardckpt.save's (method="raw"|"hyperslab", checksums=True). `async_host_bytes`: the host
    budget of async saves (a shardckpt.Saver's), allocated by the first one; None: that save's bytes on
    this rank, so that an async save blocks only while this rank's bytes are copied.

    On megatron-core 0.18 and later it also takes TorchDistSaveShardedStrategy's arguments
    (keep_only_main_replica, thread_count, cached_metadata, separation_hint, cpu_shm_mode), which
    describe torch_dist's files and change nothing here, so that megatron/training can build this
    class wherever it builds that one."""

    _TORCH_DIST = ("keep_only_main_replica", "thread_count", "cached_metadata", "separation_hint", "cpu_shm_mode")

    def __init__(self, backend=BACKEND, version=VERSION, async_host_bytes=None, **options):
        theirs = {k: options.pop(k) for k in self._TORCH_DIST if k in options and not REGISTRY}
        _SaveBase.__init__(self, backend, version, **theirs)
        unknown = sorted(set(options) - {"method", "checksums"})
        if unknown:
            raise TypeError(f"shardckpt.megatron.SaveStrategy: unknown options {unknown} (method, checksums, "
                            "async_host_bytes)")
        self._options = options
        self._async_host_bytes = async_host_bytes
        self._saver = None

    @property
    def can_handle_sharded_objects(self):
        return True

    def save(self, sharded_state_dict, checkpoint_dir):
        from . import save
        group = default_group(None)
        state, _, failure = _plan_save(sharded_state_dict, group, vote_last=False)
        # The file name is the backend's, not the user's: a link planted there is refused, not followed.
        # A refusal in the second half of planning rides in the save's first exchange.
        _collective(lambda: collective(
            lambda refused: save(state, _path(checkpoint_dir), group, follow_links=False, refused=refused, **self._options),
            group, failure if failure is None else _as_checkpointing(failure), otherwise=CheckpointingException))

    def async_save(self, sharded_state_dict, checkpoint_dir, async_strategy="nvrx"):
        """Starts the save in the library's background thread and returns Megatron's AsyncRequest for
        `async_strategy` ("mcore", or "nvrx" where nvidia-resiliency-ext is installed) whose process
        waits for it and whose finalization raises its outcome on every rank."""
        from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy
        from . import Saver
        try:
            _, modules = get_async_strategy(async_strategy)
        except (ModuleNotFoundError, TypeError) as e:
            raise CheckpointingException(f"shardckpt async save: {e}") from e
        group = default_group(None)
        state, nbytes, _ = _plan_save(sharded_state_dict, group)
        if self._saver is None:
            budget = self._async_host_bytes
            if budget is None:  # this rank's bytes (every rank makes its saver: collective)
                budget = nbytes
            self._saver = _collective(lambda: Saver(group, async_host_bytes=budget, follow_links=False))
        path = _path(checkpoint_dir)
        handle = _collective(lambda: self._saver.save_async(state, path))
        try:
            handle.wait_staged()  # Megatron has no later hook before the weights change: staged now
        except _core.Error as e:
            raise CheckpointingException(str(e)) from e
        pending = _Pending(handle, path)
        return modules["AsyncRequest"](_wait_for_commit, (pending.marker, os.getpid()), [pending.finalize],
                                       async_fn_kwargs={})


class LoadStrategy(_LoadBase):
    """The "shardckpt" backend's load: each rank reads its own parts of ckpt_dir/FILE_NAME into the
    tensors Megatron hands it. `options`: shardckpt.load_into's (method, verify_checksums=True,
    bypass_page_cache=False). `weights_only`: how ShardedObjects (and, on 0.19, the common state) are
    unpickled: True (torch.load's restricted unpickler, with Megatron's safe globals), False only for
    a checkpoint whose pickles you trust (they can run any code).

    On megatron-core 0.18 and later it is also a drop-in for Megatron's TorchDistLoadShardedStrategy
    (it takes its arguments: cache_metadata, stream_ckpt_dequant, checkpoint_name): a directory that
    holds a torch_dist checkpoint is loaded by torch_dist's own code, so megatron/training can build
    this class wherever it builds that one."""

    def __init__(self, weights_only=True, cache_metadata=False, stream_ckpt_dequant=False, checkpoint_name=None,
                 **options):
        if REGISTRY:
            _LoadBase.__init__(self)
        else:
            _LoadBase.__init__(self, cache_metadata=cache_metadata, stream_ckpt_dequant=stream_ckpt_dequant,
                               checkpoint_name=checkpoint_name)
        unknown = sorted(set(options) - {"method", "verify_checksums", "bypass_page_cache"})
        if unknown:
            raise TypeError(f"shardckpt.megatron.LoadStrategy: unknown options {unknown} (method, verify_checksums, "
                            "bypass_page_cache, weights_only)")
        self._options = options
        self._weights_only = bool(weights_only)
        # 0.19: Megatron dequantizes FP8 destinations before a strategy without streaming dequantization
        # (the library stores no FP8); torch_dist's code, for its own directories, copes either way.
        self.stream_ckpt_dequant = False

    def _theirs(self, checkpoint_dir):
        """0.18 and later: a directory of another backend, which Megatron's torch_dist code loads."""
        return not REGISTRY and not _ours(checkpoint_dir)

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

    def _contents(self, checkpoint_dir, checkpoint=None):
        """(checkpoint, objects, dtypes) of the shardckpt checkpoint in `checkpoint_dir`: the adapter's
        open checkpoint (`checkpoint` when given: one opened before, by load_common), {dataset name:
        ShardedObject unique key} and {key: dtype name} of the tensors stored as another dtype's bytes
        (the adapter's record, else this backend's older one)."""
        config = maybe_load_config(os.fspath(checkpoint_dir))
        if config is not None and config.sharded_backend != BACKEND:
            self.check_backend_compatibility(config.sharded_backend)
        if checkpoint is None:
            try:
                checkpoint = open_checkpoint(_path(checkpoint_dir))
            except _core.Error as e:
                raise CheckpointingException(str(e)) from e
        path, common = checkpoint.path, checkpoint.common
        try:
            objects = json.loads(common.get(OBJECTS_KEY, "{}"))
            bytes_as = json.loads(common.get(DTYPES_KEY, "{}"))
            if not isinstance(objects, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in objects.items()):
                raise ValueError(f"{OBJECTS_KEY} is not a map of names")
            if not isinstance(bytes_as, dict) or not all(isinstance(v, str) and v in _AS_BYTES
                                                         for v in bytes_as.values()):
                raise ValueError(f"{DTYPES_KEY} is not a map of dtypes stored as bytes")
        except (ValueError, TypeError, RecursionError) as e:
            raise CheckpointingException(f"{path}: {OBJECTS_KEY!r} or {DTYPES_KEY!r} is not what the shardckpt "
                                         f"backend writes ({type(e).__name__}: {str(e)[:200]})") from None
        recorded = recorded_dtypes(checkpoint, CheckpointingException)
        return checkpoint, objects, {**bytes_as, **recorded}

    def _dtype(self, key, info, dtypes):
        return torch_dtype(key, info, dtypes)

    def _unpickle(self, raw, what, path):
        try:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=self._weights_only)
        except Exception as e:  # noqa: BLE001 - whatever unpickling raises, said with the object's key
            hint = (" (it needs globals outside torch's and Megatron's safe ones: load with "
                    "LoadStrategy(weights_only=False) only if you trust the checkpoint)") if self._weights_only else ""
            raise CheckpointingException(f"{what} in {path}: could not be unpickled{hint}: {str(e)[:500]}") from e

    def load_common(self, checkpoint_dir):
        """Megatron's common state of a 0.19 checkpoint (the ShardedObject "common_state"), this rank
        alone; load_common_state_dict calls it for a shardckpt directory. The next load of this
        strategy class from the same directory reads the same checkpoint, or fails."""
        checkpoint, objects, _ = self._contents(checkpoint_dir)
        datasets = checkpoint.datasets
        unique_key = ShardedObject(COMMON_STATE, None, (1,), (0,)).unique_key
        name = _object_dataset(unique_key)
        if name not in objects or name not in datasets:
            raise CheckpointingException(f"{checkpoint.path}: no common state ({unique_key}): saved by megatron-core "
                                         "before 0.18, whose common state is in common.pt")
        load = Load()
        read = load.bytes(name, datasets[name]["global_shape"][0])
        try:
            _collective(lambda: load.run(checkpoint, None, **self._options))
        finally:
            checkpoint.close()
        _COMMON_READ[os.path.realpath(os.fspath(checkpoint_dir))] = checkpoint.checkpoint_id
        return self._unpickle(read.value(), "the common state", checkpoint.path)

    def load(self, sharded_state_dict, checkpoint_dir, *args):
        if self._theirs(checkpoint_dir):
            return super().load(sharded_state_dict, checkpoint_dir, *args)
        group = default_group(None)
        load, object_reads, failure, checkpoint = Load(), [], None, None
        path = _path(checkpoint_dir)
        checkpoint_id = None
        try:
            # The checkpoint Megatron's common state came from (0.19 reads it first) must be this one.
            common_from = _COMMON_READ.pop(os.path.realpath(os.fspath(checkpoint_dir)), None)
            checkpoint, objects, dtypes = self._contents(checkpoint_dir)
            path, datasets, checkpoint_id = checkpoint.path, checkpoint.datasets, checkpoint.checkpoint_id
            if common_from is not None and common_from != checkpoint_id:
                raise CheckpointingException(
                    f"{path} holds checkpoint {checkpoint_id}, not {common_from} whose common state was loaded: it "
                    "was replaced since it was opened (another save; load again); nothing was loaded")
            by_unique_key = {k: name for name, k in objects.items()}
            tensors, sharded_objects = _sharded(sharded_state_dict)
            for sh in tensors:
                self._plan(sh, path, datasets, dtypes, load)
            load.refuse_partial_overlaps(path, CheckpointingException)
            for obj in sharded_objects:
                name = by_unique_key.get(obj.unique_key)
                if name is None or name not in datasets:
                    raise CheckpointingException(f"Object shard {obj.unique_key} not found in {path}")
                object_reads.append((obj, load.bytes(name, datasets[name]["global_shape"][0])))
        except Exception as e:  # noqa: BLE001 - any refusal is voted on, so no rank waits on another
            failure = e
        # Every rank opened the same checkpoint (a save that replaced the file between two ranks' opens
        # fails the load on every rank), or every rank raises the first refusal.
        ids = _exchange(group, checkpoint_id, failure)
        if len(set(ids)) > 1:
            if checkpoint is not None:
                checkpoint.close()
            other = next(r for r, i in enumerate(ids) if i != ids[0])
            raise CheckpointingException(f"{path}: the ranks opened different checkpoints (rank 0 checkpoint {ids[0]}, "
                                         f"rank {other} checkpoint {ids[other]}): the file was replaced since it "
                                         "was opened (another save; load again); nothing was loaded")
        failure, loaded = None, {}
        try:
            # Each rank reads its parts from the file it opened, the one every rank agreed on.
            # Temporaries copied back in the order Megatron lists the tensors, as torch_dist fills them.
            load.run(checkpoint, None, **self._options)
            for obj, read in object_reads:  # unpickled before the last exchange: a bad one fails every rank
                loaded[id(obj)] = self._unpickle(read.value(), f"ShardedObject {obj.unique_key}", path)
        except Exception as e:  # noqa: BLE001 - voted on, as above
            failure = e
        finally:
            checkpoint.close()
        _exchange(group, None, failure)
        return dict_list_map_inplace(lambda v: loaded[id(v)] if isinstance(v, ShardedObject) else v.data,
                                     sharded_state_dict)

    def _plan(self, sh, path, datasets, dtypes, load):
        """Adds ShardedTensor `sh`'s part to `load` (the adapter's Load): into its tensor, or into a
        temporary of the stored dtype copied into it after the load (another dtype, not contiguous, or
        bytes another key of this load fills too: Megatron lets two keys load into views of one
        tensor). With allow_shape_mismatch (a padded vocabulary), the tensor is zeroed and the part of
        it the checkpoint holds is read (as torch_dist does)."""
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
            return  # nothing to read: a part without elements
        load.tensor(sh.key, view, self._dtype(sh.key, info, dtypes), stored, sh.global_offset)

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        """Each tensor's global shape and dtype, as Megatron's torch_dist strategy gives them: a
        ShardedTensor without data and without sharding per key (ShardedObjects left out)."""
        if self._theirs(checkpoint_dir):
            return super().load_tensors_metadata(checkpoint_dir, metadata)
        checkpoint, objects, dtypes = self._contents(checkpoint_dir)
        out = {}
        for key, info in checkpoint.datasets.items():
            if key in objects:
                continue
            meta = torch.empty(tuple(info["global_shape"]), dtype=self._dtype(key, info, dtypes), device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir):
        """load_tensors_metadata's tensors and each ShardedObject, keyed by its unique key, without data."""
        if self._theirs(checkpoint_dir):
            return super().load_sharded_metadata(checkpoint_dir)
        _, objects, _ = self._contents(checkpoint_dir)
        out = {}
        for unique_key in objects.values():
            obj = ShardedObject.empty_from_unique_key(unique_key)
            out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir))
        return out

    def remove_sharded_tensors(self, checkpoint_dir, key_prefix):
        if self._theirs(checkpoint_dir):
            return super().remove_sharded_tensors(checkpoint_dir, key_prefix)
        raise CheckpointingException(f"{_path(checkpoint_dir)}: a shardckpt checkpoint is one sealed file; removing "
                                     f"the tensors under {key_prefix!r} from it is not supported (save the state "
                                     "dict without them instead)")


# The checkpoint (the adapter's open checkpoint) each directory's common state was read from (0.19),
# for the load that follows: it loads from the same one.
_COMMON_READ = {}


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
    shard = param_shard(param, "gtp_sharded_state_dict")
    out = {}
    for piece in param.pieces():
        data = shard[piece["shard_row"]:piece["shard_row"] + piece["rows"]]
        rid = replica_id if replica_id is not None else (
            0 if piece["main_replica"] else param.tp_rank, param.replica_id)
        key = prefix + piece["key"]
        out[key] = ShardedTensor(key, data, data.dtype, tuple(piece["count"]), tuple(piece["global_shape"]),
                                 tuple(piece["global_offset"]), axis_fragmentations=None, replica_id=rid)
    return out


def _ours(checkpoint_dir):
    """Whether `checkpoint_dir` holds a checkpoint of this backend (its metadata.json says so)."""
    try:
        config = maybe_load_config(os.fspath(checkpoint_dir))
    except (OSError, ValueError, TypeError):
        return False
    return config is not None and config.sharded_backend == BACKEND


def _is_our_load(strategy):
    base = getattr(strategy, "base_strategy", None)  # FullyParallelLoadStrategyWrapper
    return isinstance(strategy, LoadStrategy) or isinstance(base, LoadStrategy)


def _refuse_other_strategy(checkpoint_dir, strategy, what):
    if _ours(checkpoint_dir) and not _is_our_load(strategy):
        given = "no sharded_strategy" if strategy is None else f"sharded_strategy={type(strategy).__name__}"
        raise CheckpointingException(
            f"{checkpoint_dir} holds a shardckpt checkpoint (metadata.json: sharded_backend {BACKEND!r}); "
            f"{what} was given {given}: pass sharded_strategy=shardckpt.megatron.LoadStrategy()")


def _install_on_megatron_without_registry():
    """megatron-core 0.18 and later: what a load of a shardckpt directory needs from Megatron's own
    functions (they read torch_dist's files unless told otherwise)."""
    if getattr(_serialization, "_shardckpt_installed", False):
        return
    original_common = _serialization.load_common_state_dict
    original_load = _serialization.load
    original_tensors = _serialization.load_tensors_metadata
    original_sharded = _serialization.load_sharded_metadata
    original_remove = _serialization.remove_sharded_tensors

    def load_common_state_dict(checkpoint_dir):
        if _ours(checkpoint_dir):
            return LoadStrategy().load_common(checkpoint_dir)
        return original_common(checkpoint_dir)

    def load(sharded_state_dict, checkpoint_dir, sharded_strategy=None, *args, **kwargs):
        _refuse_other_strategy(checkpoint_dir, sharded_strategy, "dist_checkpointing.load")
        return original_load(sharded_state_dict, checkpoint_dir, sharded_strategy, *args, **kwargs)

    def load_tensors_metadata(checkpoint_dir, sharded_strategy=None):
        _refuse_other_strategy(checkpoint_dir, sharded_strategy, "load_tensors_metadata")
        return original_tensors(checkpoint_dir, sharded_strategy)

    def load_sharded_metadata(checkpoint_dir, sharded_strategy=None):
        _refuse_other_strategy(checkpoint_dir, sharded_strategy, "load_sharded_metadata")
        return original_sharded(checkpoint_dir, sharded_strategy)

    def remove_sharded_tensors(checkpoint_dir, key_prefix):
        if _ours(checkpoint_dir):
            return LoadStrategy().remove_sharded_tensors(checkpoint_dir, key_prefix)
        return original_remove(checkpoint_dir, key_prefix)

    for name, f, original in (("load_common_state_dict", load_common_state_dict, original_common),
                              ("load", load, original_load),
                              ("load_tensors_metadata", load_tensors_metadata, original_tensors),
                              ("load_sharded_metadata", load_sharded_metadata, original_sharded),
                              ("remove_sharded_tensors", remove_sharded_tensors, original_remove)):
        f.__doc__ = original.__doc__
        f.__wrapped__ = original
        setattr(_serialization, name, f)
        if getattr(_dist_checkpointing, name, None) is original:
            setattr(_dist_checkpointing, name, f)
    _serialization._shardckpt_installed = True


if REGISTRY:
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())
else:
    _install_on_megatron_without_registry()
