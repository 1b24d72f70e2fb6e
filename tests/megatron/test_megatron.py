"""Megatron-core 0.16 or 0.19 (torch 2.x, PyPI) on CPU under gloo: the "shardckpt" backend of
dist_checkpointing and GTP pieces as Megatron ShardedTensors, on 4 processes (tests/megatron/worker.py
runs every case in one job; each test here checks its case on every rank)."""
import os
import sys
import subprocess
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from support import GlooJobCase, check_example  # noqa: E402

WORLD = 4
WORKER = os.path.join(os.path.dirname(__file__), "worker.py")

def _registry():
    """megatron-core before 0.18 registers strategies by name; later ones take strategy objects
    (and have async saves through AsyncRequest, which this backend serves there)."""
    import importlib.util
    return importlib.util.find_spec("megatron.core.dist_checkpointing.strategies.base") is not None


REGISTRY = _registry()
CASES = ["model", "gtp", "gpt", "bad", "found", "guards"] + ([] if REGISTRY else ["async"])


class MegatronJob(GlooJobCase, unittest.TestCase):
    WORLD, WORKER, CASES = WORLD, WORKER, CASES

    def test_megatron_state_dicts_saved_by_the_backend_load_at_other_shardings_as_torch_dist_does(self):
        self.check("model")

    def test_gtp_pieces_save_under_both_backends_and_load_at_another_gtp(self):
        self.check("gtp")

    def test_megatron_gpt_model_through_both_backends_at_tp_2_4_and_1(self):
        self.check("gpt")

    def test_bad_input_fails_on_every_rank_and_commits_nothing(self):
        self.check("bad")

    def test_empty_parts_are_nobodys_replicas_and_aliased_destinations_load_as_torch_dist_loads_them(self):
        self.check("found")

    def test_planted_links_pickles_other_strategies_integrity_and_fully_parallel_wrappers(self):
        self.check("guards")

    @unittest.skipIf(REGISTRY, "megatron-core before 0.18: its async saves need an AsyncSaveShardedStrategy of the "
                               "registry era, which this backend is not (use shardckpt.Saver)")
    def test_async_saves_through_megatrons_queue_commit_at_finalization_and_fail_on_every_rank(self):
        self.check("async")


@unittest.skipIf(REGISTRY, "megatron-core before 0.18 has no async path for this backend")
class KilledRank(unittest.TestCase):
    def test_a_rank_killed_during_an_async_save_leaves_a_complete_checkpoint_and_fails_the_others(self):
        import tempfile
        import time
        from support import run_ranks
        import shardckpt as sc
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "ckpt")
            t0 = time.monotonic()
            results = run_ranks(WORLD, os.path.join(os.path.dirname(__file__), "kill_worker.py"), path, timeout=240)
            self.assertLess(time.monotonic() - t0, 200, "the surviving ranks waited for the dead one")
            self.assertEqual(results[3][0], -9, results[3][1][-2000:])
            for rank in range(3):  # they learn of it: none reports a finished save
                code, out = results[rank]
                self.assertNotIn("finalized", out, f"rank {rank}:\n{out[-2000:]}")
                self.assertNotEqual(code, 0, f"rank {rank}:\n{out[-2000:]}")
            # The directory holds one whole checkpoint: the first save's (or, had the kill come after
            # the commit, the second's), every byte verified; no temporary file is left.
            file = os.path.join(path, "shardckpt.h5")
            sc.verify(file)
            got = sc.read(file)
            w = got["w"]
            self.assertIn(float(w[0, 0]), (1.0, 2.0))
            self.assertTrue(bool((w == w[0, 0]).all()), "a mix of two saves")
            # Ranks 0-2 leave by os._exit once Megatron's finalization fails, which its own all_reduce
            # may learn before the library's save in flight does (that save waits out the group's 60 s
            # timeout): rank 0's temporary file may then stay, as after any process killed mid-save.
            # Nothing else may: at most that one file, under its unpredictable hidden name.
            left = [n for n in os.listdir(path) if n.endswith(".partial")]
            self.assertLessEqual(len(left), 1, left)
            for n in left:
                self.assertRegex(n, r"^\.shardckpt\.h5\.[0-9a-f]{32}\.partial$")


class Examples(unittest.TestCase):
    def test_megatron_gtp_example_on_four_processes(self):
        check_example(self, "megatron_gtp.py", "loaded at TP 1 x GTP 4, pad rows zero", WORLD)


class Package(unittest.TestCase):
    def test_shardckpt_megatron_is_the_backend_module_when_named_after_import_shardckpt(self):
        code = "import shardckpt; m = shardckpt.megatron; print(m.__name__, m.BACKEND, m.VERSION)"
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr[-2000:])
        self.assertEqual(out.stdout.split(), ["shardckpt.megatron", "shardckpt", "1"])


if __name__ == "__main__":
    unittest.main()
