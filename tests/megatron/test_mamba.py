"""shardckpt's no_gather(model) on megatron-core 0.19's MambaMixer (torch 2.x, CPU, gloo): its
GTP-sharded in_proj.weight saved as the library's pieces, no all-gather, the keys and global shapes of
the mixer without GTP, loaded in place at another TP and GTP, with plain Adam's optimizer state, under
torch_dist (and the "shardckpt" backend where shardckpt.megatron imports under this megatron-core), on 4
processes (tests/megatron/mamba_worker.py runs every case in one job; each test here checks its case
on every rank). Skipped where the megatron-core found (PYTHONPATH first) is older than 0.19, which has
no GTP."""
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from support import GlooJobCase  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from versions import megatron_version, older_than  # noqa: E402


VERSION = megatron_version()


@unittest.skipIf(older_than(VERSION, (0, 19)),
                 f"no_gather needs megatron-core 0.19 or later (GTP); found {VERSION or 'none'}")
class MambaNoGatherJob(GlooJobCase, unittest.TestCase):
    WORLD = 4
    WORKER = os.path.join(os.path.dirname(__file__), "mamba_worker.py")
    CASES = ["pieces", "save_load", "padding_only", "refused"]

    def test_pieces_are_views_with_the_keys_and_shapes_of_the_mixer_without_gtp_and_no_collective(self):
        self.check("pieces")

    def test_a_save_at_gtp_4_loads_in_place_at_gtp_2_and_without_gtp_with_megatrons_adam_state(self):
        self.check("save_load")

    def test_a_padding_only_rank_saves_nothing_and_loads_its_zero_shard_in_place(self):
        self.check("padding_only")

    def test_flattened_ranges_and_quantized_shards_are_refused_naming_key_and_rank(self):
        self.check("refused")


if __name__ == "__main__":
    unittest.main()
