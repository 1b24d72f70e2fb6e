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
