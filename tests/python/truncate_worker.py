"""Runs shardckpt.read of a 64 MiB tensor while another thread cuts the file short to 1 MiB a few
milliseconds after the read starts, `tries` times (test_truncated.py runs it in a subprocess, which
must never die by a signal). Prints one JSON line: how each try ended."""
import json
import os
import shutil
import sys
import threading
import time

import torch

import shardckpt as sc


def drop_pages(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(directory, tries):
    master = os.path.join(directory, "master.h5")
    path = os.path.join(directory, "w.h5")
    want = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    state = sc.StateDict()
    state.add(sc.ShardedTensor("w", want, list(want.shape), [0]))
    sc.save(state, master)
    drop = os.environ.get("DROP", "1") == "1"

    def fresh_copy():
        shutil.copyfile(master, path)
        if drop:
            drop_pages(path)

    # How long a read takes here: the cuts are spread over it.
    spans = []
    for _ in range(2):
        fresh_copy()
        start = time.perf_counter()
        got = sc.read(path)
        spans.append(time.perf_counter() - start)
        assert torch.equal(got["w"], want)
        del got
    span = min(spans)
    outcomes = {}
    for i in range(tries):
        fresh_copy()
        delay = span * (0.2 + 0.75 * (i % 8) / 7)  # the first fifth or so opens the file
        lock = threading.Lock()
        flags = {"returned": False, "cut": False}

        def cut():
            time.sleep(delay)
            with lock:
                if not flags["returned"]:
                    os.truncate(path, 1 << 20)
                    flags["cut"] = True

        cutter = threading.Thread(target=cut)
        cutter.start()
        try:
            got = sc.read(path)
            with lock:
                flags["returned"] = True
                cut_before = flags["cut"]
            if cut_before:
                # Cut short after the last row was checked: its tensor is over lost pages (the
                # documented limit of map=True): not touched.
                outcome = "returned_then_cut"
            else:
                assert torch.equal(got["w"], want), "a read that returned holds other bytes"
                outcome = "returned"
            del got
        except sc.Error as e:
            outcome = e.code
        cutter.join()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(json.dumps({"read_seconds": span, "outcomes": outcomes}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
