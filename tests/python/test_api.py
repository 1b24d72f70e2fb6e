"""The Python package in one process: round trips through DLPack without copies, the state dict's
ownership of the tensors it refers to, the errors users see, and the GIL released while it works."""
import faulthandler
import gc
import os
import shutil
import sys
import tempfile
import threading
import time
import unittest
import weakref

import numpy as np
import torch

import shardckpt as sc
from support import reference, shard_of, spec_at


def param(tp=1, gtp=1, align=0, tp_rank=0, gtp_rank=0, shard=None, kind="gdp"):
    return sc.ShardedParam(spec_at(tp, kind), gtp=gtp, align=align, tp_rank=tp_rank, gtp_rank=gtp_rank, shard=shard,
                           dtype=torch.bfloat16 if shard is None else None)


class HeldGroup:
    """One process as a Python group: the library calls it with the GIL. A background save's calls
    (from any thread but the main one) wait for `go` first, so that a test knows where the save is;
    the first of them runs `first` (another thread's work while the caller waits)."""

    def __init__(self):
        self.go = threading.Event()
        self.background_calls = 0
        self.first = None

    def _held(self):
        if threading.current_thread() is not threading.main_thread():
            self.background_calls += 1
            if self.first is not None:
                self.first, first = None, self.first
                first()
            self.go.wait()

    def rank(self): return 0
    def size(self): return 1
    def barrier(self): pass
    def split(self, color, key): return self
    def all_gather_rows(self, rows, counts): pass
    def device_index(self): return -1
    def supports_background(self): return True

    def broadcast_bytes(self, data, root):
        self._held()
        return data

    def all_gather_bytes(self, data):
        self._held()
        return [data]


def big_state(rows=1024):
    """A 16 MiB f32 parameter and its state dict: 8 budgets of the saver the tests make."""
    t = torch.rand(rows, 4096)
    s = sc.StateDict()
    s.add(sc.ShardedParam(sc.ParamSpec("big", sc.plain_sections(rows), [4096]), 1, 0, 0, 0, shard=t))
    return t, s


class Api(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-api-")
        self.path = os.path.join(self.dir, "a.h5")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def save_reference(self):
        state = sc.StateDict()
        state.add(param(shard=reference(1, 0)))
        state.add_common("step", 3)
        state.add_common("lr", 0.5)
        state.add_common("run", "a")
        sc.save(state, self.path)

    def test_round_trip_at_gtp_with_pad_rows_zeroed(self):
        self.save_reference()
        for gtp, align in [(3, 8), (2, 16), (5, 1)]:
            for g in range(gtp):
                p = param(gtp=gtp, align=align, gtp_rank=g, shard=torch.full((1,), 0, dtype=torch.bfloat16)
                          .expand(param(gtp=gtp, align=align, gtp_rank=g).padded_shape()).contiguous() + 5)
                s = sc.StateDict()
                s.add(p)
                self.assertEqual(sc.load_into(self.path, s), {"step": 3, "lr": 0.5, "run": "a"})
                self.assertTrue(torch.equal(p.shard, shard_of(reference(1, 0), p)), (gtp, align, g))

    def test_load_into_fills_the_callers_tensor_in_place(self):
        self.save_reference()
        dest = torch.zeros(param().padded_shape(), dtype=torch.bfloat16)
        address = dest.data_ptr()
        s = sc.StateDict()
        p = param(shard=dest)
        s.add(p)
        sc.load_into(self.path, s)
        self.assertIs(p.shard, dest)
        self.assertEqual(dest.data_ptr(), address)
        self.assertTrue(torch.equal(dest, reference(1, 0)))

    def test_the_state_dict_keeps_its_tensors_alive(self):
        def state_with_a_tensor_nobody_else_holds():
            t = reference(1, 0).clone()
            s = sc.StateDict()
            s.add(param(shard=t))
            return s, weakref.ref(t)
        state, seen = state_with_a_tensor_nobody_else_holds()
        gc.collect()
        self.assertIsNotNone(seen(), "the state dict must hold its tensor")
        sc.save(state, self.path)
        self.assertTrue(torch.equal(sc.read(self.path)[spec_at(1).key], reference(1, 0)))
        del state
        gc.collect()
        self.assertIsNone(seen(), "the tensor must go with the last state dict that holds it")

    def test_numpy_arrays_through_dlpack(self):
        a = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
        spec = sc.ParamSpec("w", sc.plain_sections(4), [6])
        s = sc.StateDict()
        s.add(sc.ShardedParam(spec, 1, 0, 0, 0, shard=a))
        sc.save(s, self.path)
        back = np.zeros_like(a)
        s2 = sc.StateDict()
        s2.add(sc.ShardedParam(spec, 1, 0, 0, 0, shard=back))
        sc.load_into(self.path, s2)
        self.assertTrue(np.array_equal(back, a))

    def test_load_allocates_a_request(self):
        self.save_reference()
        req = sc.StateDict()
        req.add(param(gtp=2, align=16, gtp_rank=1))
        got = sc.load(self.path, req)
        p = param(gtp=2, align=16, gtp_rank=1)
        self.assertEqual(got["step"], 3)
        self.assertTrue(torch.equal(got[spec_at(1).key], shard_of(reference(1, 0), p)))

    def test_sharded_tensors_and_their_requests(self):
        t = torch.arange(24, dtype=torch.int64).reshape(6, 4)
        s = sc.StateDict()
        s.add(sc.ShardedTensor("counts", t, [6, 4], [0, 0]))
        sc.save(s, self.path)
        req = sc.StateDict()
        req.add(sc.ShardedTensor.expect("counts", torch.int64, [2, 4], [6, 4], [4, 0]))
        self.assertTrue(torch.equal(sc.load(self.path, req)["counts"], t[4:]))

    def test_an_open_checkpoint_is_one_file_whatever_replaces_its_path(self):
        path = os.path.join(self.dir, "open.h5")

        def save(value, step):
            st = sc.StateDict()
            st.add(sc.ShardedTensor("w", torch.full((64, 8), float(value)), [64, 8], [0, 0]))
            st.add_common("step", step)
            sc.save(st, path)

        save(1, 1)
        ck = sc.open(path)
        first = ck.checkpoint_id
        self.assertEqual(ck.inspect()["checkpoint_id"], first)
        self.assertEqual(ck.inspect()["common"]["step"], 1)
        save(2, 2)  # another save replaces the path: the open checkpoint is still the first
        self.assertNotEqual(sc.inspect(path)["checkpoint_id"], first)
        self.assertEqual(ck.inspect()["common"]["step"], 1)
        target = torch.zeros(64, 8)
        into = sc.StateDict()
        into.add(sc.ShardedTensor("w", target, [64, 8], [0, 0]))
        self.assertEqual(ck.load_into(into)["step"], 1)
        self.assertTrue(torch.equal(target, torch.full((64, 8), 1.0)))
        request = sc.StateDict()
        request.add(sc.ShardedTensor.expect("w", torch.float32, [64, 8], [64, 8], [0, 0]))
        self.assertTrue(torch.equal(ck.load(request)["w"], torch.full((64, 8), 1.0)))
        with sc.open(path) as again:  # the path now: the second save
            self.assertEqual(again.load(request)["w"][0, 0].item(), 2.0)
        self.assertTrue(again.closed)
        ck.close()
        with self.assertRaises(sc.Error) as e:
            ck.load_into(into)
        self.assertIn("closed", str(e.exception))

    def test_a_refusal_fails_the_call_before_anything_is_written_or_read(self):
        path = os.path.join(self.dir, "refused.h5")
        st = sc.StateDict()
        t = torch.ones(4, 4)
        st.add(sc.ShardedTensor("w", t, [4, 4], [0, 0]))
        with self.assertRaises(sc.Error) as e:
            sc.save(st, path, refused="w: not saved on purpose")
        self.assertEqual(e.exception.code, "invalid_argument")
        self.assertIn("w: not saved on purpose", str(e.exception))
        self.assertFalse(os.path.exists(path))
        sc.save(st, path)
        t.zero_()
        with self.assertRaises(sc.Error) as e:
            sc.load_into(path, st, refused="not loaded on purpose")
        self.assertEqual(e.exception.code, "invalid_argument")
        self.assertEqual(t.sum().item(), 0.0)

    def test_errors_name_the_key(self):
        key = spec_at(1).key
        full = reference(1, 0)
        for bad, kind in [(full.t(), ValueError), (full[:3], ValueError), (full.to(torch.complex64), TypeError),
                          (torch.tensor(1.0), ValueError), ([1, 2], TypeError)]:
            with self.assertRaises(kind) as e:
                param(shard=bad)
            self.assertIn(key, str(e.exception))
        with self.assertRaises(TypeError):
            sc.ShardedParam(spec_at(1), 1, 0, 0, 0, shard=full, dtype=torch.float32)
        with self.assertRaises(sc.Error) as e:
            sc.load_into(os.path.join(self.dir, "none.h5"), sc.StateDict())
        self.assertEqual(e.exception.code, "not_a_checkpoint")
        self.assertIsInstance(e.exception, RuntimeError)
        with self.assertRaises(sc.Error) as e:
            sc.gdp_in_proj_sections(sc.SsmDims(8, 4, 4, 4, 2), 3)
        self.assertEqual(e.exception.code, "layout")
        s = sc.StateDict()
        s.add_common("step", 1)
        with self.assertRaises(sc.Error) as e:
            s.add_common("step", 2)
        self.assertEqual(e.exception.code, "invalid_argument")
        with self.assertRaises(TypeError):
            s.add_common("x", [1])

    def test_a_tp_that_splits_a_head_is_refused_with_the_one_message(self):
        self.save_reference()
        self.assertEqual(sc.inspect(self.path)["params"][0]["divisors"], [("heads", 8), ("groups", 4)])
        for tp, what in [(3, "heads (8) does not divide by TP 3"), (8, "groups (4) does not divide by TP 8")]:
            with self.assertRaises(sc.Error) as e:
                sc.read(self.path, tp=tp)
            self.assertEqual(e.exception.code, "layout")
            self.assertEqual(str(e.exception), f"{spec_at(1).key}: {what}")
        with self.assertRaises(sc.Error) as e:
            sc.ParamSpec("w", sc.plain_sections(6), [4], tp=3, divisors=[sc.TpDivisor("heads", 8)])
        self.assertEqual(str(e.exception), "w: heads (8) does not divide by TP 3")

    def test_verify_raises_on_damage(self):
        self.save_reference()
        self.assertEqual(sc.verify(self.path)["mismatches"], 0)
        info = sc.inspect(self.path)
        self.assertEqual(info["common"], {"step": 3, "lr": 0.5, "run": "a"})
        self.assertEqual([k for k, _ in info["params"][0]["blocks"]][0], spec_at(1).key + ".z")
        import h5py
        with h5py.File(self.path, "r") as f:
            offset = f[spec_at(1).key + ".z"].id.get_offset()
        with open(self.path, "r+b") as f:
            f.seek(offset + 2)
            f.write(b"\x7f")
        with self.assertRaises(sc.Error) as e:
            sc.verify(self.path)
        self.assertEqual(e.exception.code, "corrupt")

    def test_async_save_in_one_process(self):
        t = reference(1, 0).clone()
        s = sc.StateDict()
        s.add(param(shard=t))
        saver = sc.Saver()
        handle = saver.save_async(s, self.path)
        t.fill_(0)  # staged already
        handle.wait()
        self.assertTrue(handle.done())
        self.assertTrue(torch.equal(sc.read(self.path)[spec_at(1).key], reference(1, 0)))
        self.assertGreater(saver.staging_bytes(), 0)

    def test_a_bounded_async_save_of_host_tensors_returns_once_it_has_read_them_without_the_gil(self):
        t, s = big_state()
        original = t.clone()
        group = HeldGroup()
        saver = sc.Saver(group, staging_buffer_bytes=1 << 20)
        self.assertEqual(saver.async_host_bytes(), 2 << 20)
        # The save's planning waits for group.go, which the timer's thread sets: save_async returns
        # only once the save has read every host row (Python code may free them as soon as it
        # returns), and the timer's thread runs only if save_async waits without the GIL; if it did
        # not, this process would stop here: the dump ends it in time.
        threading.Timer(0.1, group.go.set).start()
        faulthandler.dump_traceback_later(60, exit=True)
        try:
            handle = saver.save_async(s, self.path)
        finally:
            faulthandler.cancel_dump_traceback_later()
        self.assertTrue(handle.staged())
        self.assertGreater(group.background_calls, 0)
        t.fill_(0)  # the optimizer step
        handle.wait_staged()
        handle.wait()
        self.assertTrue(torch.equal(sc.read(self.path)["big"], original))
        # Host tensors stream from where they are; the budget was held from the start all the same.
        self.assertEqual(saver.staging_bytes(), saver.async_host_bytes())

    def test_a_savers_budget_is_held_when_it_is_made_or_at_reserve(self):
        group = HeldGroup()
        group.go.set()
        saver = sc.Saver(group, staging_buffer_bytes=1 << 20, async_host_bytes=3 << 20)
        self.assertEqual(saver.staging_bytes(), 3 << 20)
        later = sc.Saver(group, staging_buffer_bytes=1 << 20, reserve=False)
        self.assertEqual(later.staging_bytes(), 0)
        later.reserve()
        later.reserve()
        self.assertEqual(later.staging_bytes(), 2 << 20)
        t, s = big_state()
        later.save_async(s, self.path).wait()
        self.assertTrue(torch.equal(sc.read(self.path)["big"], t))
        self.assertEqual(later.staging_bytes(), 2 << 20)
        later.close()
        with self.assertRaises(sc.Error):
            later.reserve()

    def test_a_tensor_changed_before_the_save_read_it_fails_a_checked_save(self):
        t, s = big_state()
        group = HeldGroup()
        group.go.set()
        group.first = lambda: t[3:5].fill_(7)  # another thread, while save_async waits: too early
        saver = sc.Saver(group, staging_buffer_bytes=1 << 20, check_unchanged=True)
        handle = saver.save_async(s, self.path)
        with self.assertRaises(sc.Error) as e:
            handle.wait()
        self.assertEqual(e.exception.code, "shard_changed")
        self.assertIn("key big: 2 of rows [3, 5)", str(e.exception))
        self.assertIn("wait_staged() returns (the check_unchanged option)", str(e.exception))
        self.assertNotIn("::", str(e.exception))  # the Python API's words, not the C++ API's
        self.assertFalse(os.path.exists(self.path))

    def test_saves_release_the_gil(self):
        spec = sc.ParamSpec("big", sc.plain_sections(4096), [8192])
        s = sc.StateDict()
        s.add(sc.ShardedParam(spec, 1, 0, 0, 0, shard=torch.ones(4096, 8192)))  # 128 MiB
        count, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                count[0] += 1
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        worker = threading.Thread(target=spin)
        worker.start()
        try:
            time.sleep(0.2)  # the spinner's rate while this thread waits without the GIL
            before = count[0]
            time.sleep(0.2)
            rate = (count[0] - before) / 0.2
            start, before = time.time(), count[0]
            sc.save(s, self.path)
            during, seconds = count[0] - before, time.time() - start
        finally:
            stop.set()
            worker.join()
            sys.setswitchinterval(old)
        # Holding the GIL, a 1 ms switch interval would give the spinner a few ms of the save (about 5%
        # of it, measured); released, the spinner runs through nearly all of it (about 97%).
        self.assertGreater(during, 0.3 * rate * seconds, (during, rate, seconds))


if __name__ == "__main__":
    unittest.main()
