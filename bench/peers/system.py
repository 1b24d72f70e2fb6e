"""The page cache, peak memory and medians, as shardckpt-bench measures them (bench/system.cpp)."""
import ctypes
import os
import shutil
import statistics
import threading
import time

_libc = ctypes.CDLL("libc.so.6")


def _write_proc(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def drops_page_cache():
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def cache_method():
    if os.environ.get("PEERS_WARM_CACHE") == "1":
        return "warm: synced, the page cache kept (--warm-cache)"
    return "sync + echo 3 > /proc/sys/vm/drop_caches" if drops_page_cache() else "fdatasync + posix_fadvise(DONTNEED)"


def cold(directory):
    """Everything synced and the page cache dropped (where that is not writable, every file under
    `directory` evicted). With PEERS_WARM_CACHE=1 (bench/peers.py --warm-cache, for profiling) only
    synced: what each side costs beside the disk."""
    os.sync()
    if os.environ.get("PEERS_WARM_CACHE") == "1":
        return
    if _write_proc("/proc/sys/vm/drop_caches", "3"):
        return
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def on_disk(path):
    """(bytes, files) of a checkpoint: one file, or every file of a directory."""
    if os.path.isfile(path):
        return os.path.getsize(path), 1
    sizes = [os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names]
    return sum(sizes), len(sizes)


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class PeakMeter:
    """The resident memory a phase adds at its peak: VmHWM after it minus VmRSS before it, VmHWM
    reset by /proc/self/clear_refs (where that is not writable, VmRSS sampled every millisecond).
    The workers run with glibc's mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so freed
    tensors go back to the system and no phase inherits memory an earlier one faulted in."""

    def __init__(self):
        self.exact = _write_proc("/proc/self/clear_refs", "5")
        self._rss0 = self._max = 0
        self._stop = None

    def method(self):
        return "VmHWM reset by /proc/self/clear_refs" if self.exact else "VmRSS sampled every 1 ms"

    def begin(self):
        _libc.malloc_trim(0)
        self._rss0 = status_bytes("VmRSS:")
        if self.exact:
            _write_proc("/proc/self/clear_refs", "5")
            return
        self._max, self._stop = self._rss0, threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        while not self._stop.is_set():
            self._max = max(self._max, status_bytes("VmRSS:"))
            time.sleep(0.001)

    def end(self):
        """(bytes added at the peak, the peak's resident bytes)."""
        if self.exact:
            peak = status_bytes("VmHWM:")
        else:
            self._stop.set()
            peak = max(self._max, status_bytes("VmRSS:"))
        return max(0, peak - self._rss0), peak


def spread(values):
    """The median of the rounds, their least and greatest value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class Rounds:
    """The timed phases of one gloo job, shared by the jobs that compare storages side by side. A
    subclass sets rank, dir, meter (a PeakMeter), records ({}), mismatches ([]) and isolated (one
    side alone: its own high-water mark, never reset by a phase), and has save(side),
    load(side, timed) and local_bytes()."""

    def prepare(self, old=None, recreate=False):
        """Untimed: the last round's checkpoint `old` removed (made again, empty, with `recreate`, for
        a side that saves into an existing directory), everything synced, the page cache dropped."""
        import torch.distributed as dist
        dist.barrier()
        if self.rank == 0:
            if old:
                remove(old)
                if recreate:
                    os.makedirs(old)
            cold(self.dir)
        dist.barrier()
        if not self.isolated:
            self.meter.begin()
        dist.barrier()

    def timed(self, name, fn, old=None, recreate=False):
        """Runs fn() as phase `name`, from a barrier to a barrier, after prepare(old, recreate)."""
        import torch.distributed as dist
        self.prepare(old, recreate)
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - t0
        extra, peak = (0, 0) if self.isolated else self.meter.end()
        self.records.setdefault(name, []).append({"seconds": seconds, "peak_extra": extra, "peak": peak})

    def run(self, sides, rounds, read_rounds, loads=None):
        """`rounds` saves of every side, which goes first alternating; one untimed load of each of
        `loads` (default: the sides); `read_rounds` timed loads. Every rank's records, gathered."""
        import resource
        import torch.distributed as dist
        loads = sides if loads is None else loads
        rss_before, hwm_before = status_bytes("VmRSS:"), status_bytes("VmHWM:")
        for i in range(rounds):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                self.save(side)
        for side in loads:
            self.load(side, timed=False)
        for i in range(read_rounds):
            for side in (loads if i % 2 == 0 else loads[::-1]):
                self.load(side)
        mine = {"records": self.records, "mismatches": self.mismatches, "local_bytes": self.local_bytes(),
                "rss_before": rss_before, "hwm_before": hwm_before,
                "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone
