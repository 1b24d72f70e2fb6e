"""One process of a gloo job under megatron-core 0.18 or later (tests/megatron/test_megatron.py,
KilledRank): saves a small state synchronously, then starts an async save of a larger one through
Megatron's AsyncCallsQueue; rank 3 is SIGKILLed as soon as dist_checkpointing.save returns (its
rows staged, the background save in flight); the others wait for the outcome at finalization and
print it. The test then checks the directory: a complete checkpoint that verifies."""
import datetime
import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402

import shardckpt.megatron as scm  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
ROWS = 1 << 20  # rows of 4 floats per rank in the async save: 16 MiB each


def state(v, rows):
    w = torch.full((rows, 4), float(v))
    return {"w": ShardedTensor.from_rank_offsets("w", w, (0, RANK, WORLD)), "step": v}


def main():
    path = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if RANK == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state(1, 4), path, sharded_strategy=scm.SaveStrategy())
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save(state(2, ROWS), path, sharded_strategy=scm.SaveStrategy(),
                                      async_sharded_save=True, async_strategy="mcore")
    if RANK == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        print("finalized", flush=True)
    except BaseException as e:  # noqa: BLE001 - the outcome is what the test reads
        print(f"failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        os._exit(3)
    os._exit(0)


if __name__ == "__main__":
    main()
