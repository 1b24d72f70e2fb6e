"""GTP shards through Megatron-core's local (non-persistent) checkpoints (megatron-core 0.19 with
nvidia-resiliency-ext, torch 2.x, CPU, gloo): MCoreTensorAwareStateDict.from_state_dict, nvrx's
LocalCheckpointManager save and load, to_state_dict, with algo "atomic" and "fully_parallel", for
shardckpt's gtp_shard_factory (in Megatron's own merge order) and no_gather's factory (through
shardckpt's to_state_dict), at the seed geometry (61,760 rows, GTP 64, alignment 32: GTP rank 62
partly padded, 63 padding-only; each of 4 processes plays one GTP rank) and on a real MambaMixer.
tests/megatron/local_worker.py runs every case in one job; each test here checks its case on every
rank. Skipped where the megatron-core found (PYTHONPATH first) is older than 0.19 or
nvidia-resiliency-ext is missing."""
import importlib.util
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from support import GlooJobCase  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from versions import megatron_version, older_than  # noqa: E402


VERSION = megatron_version()
NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None


@unittest.skipIf(older_than(VERSION, (0, 19)),
                 f"local checkpoints of GTP shards need megatron-core 0.19 or later; found {VERSION or 'none'}")
@unittest.skipIf(not NVRX, "Megatron's local checkpoints need nvidia-resiliency-ext, which is not installed")
class LocalCheckpointJob(GlooJobCase, unittest.TestCase):
    WORLD = 4
    WORKER = os.path.join(os.path.dirname(__file__), "local_worker.py")
    CASES = ["seed_atomic", "seed_fully_parallel", "placeholder", "placeholder_main", "no_gather"]

    def test_seed_geometry_round_trips_atomic_in_megatrons_order_padding_only_zero_nothing_padded_saved(self):
        self.check("seed_atomic")

    def test_seed_geometry_round_trips_fully_parallel_with_the_exchange_between_replicas(self):
        self.check("seed_fully_parallel")

    def test_a_padding_only_rank_builds_one_zero_element_placeholder_and_others_views(self):
        self.check("placeholder")

    def test_of_the_data_parallel_replicas_of_a_padding_only_rank_one_builds_the_main_placeholder(self):
        self.check("placeholder_main")

    def test_no_gather_mixer_round_trips_through_shardckpts_to_state_dict(self):
        self.check("no_gather")


if __name__ == "__main__":
    unittest.main()
