"""torch CUDA tensors through DLPack, on a GPU (scripts/gpu-check.sh runs this; without a CUDA device
for torch every test is skipped): a bounded async save streams the weights from CUDA memory while a
forward pass reads them, the optimizer step after wait_staged() is not saved, and a load fills CUDA
tensors in place."""
import os
import shutil
import tempfile
import unittest

import torch

import shardckpt as sc


@unittest.skipUnless(torch.cuda.is_available(), "torch has no CUDA device here")
class CudaTensors(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="sc-cuda-")
        self.path = os.path.join(self.dir, "a.h5")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_bounded_async_save_of_cuda_tensors_and_a_load_in_place(self):
        spec = sc.ParamSpec("w", sc.plain_sections(4096), [4096])
        w = torch.randn(4096, 4096, device="cuda:0")  # 64 MiB through a budget of 8 MiB
        before = w.cpu()
        state = sc.StateDict()
        state.add(sc.ShardedParam(spec, 1, 0, 0, 0, shard=w))
        saver = sc.Saver(cuda_device=0, staging_buffer_bytes=4 << 20, check_unchanged=True)
        self.assertEqual(saver.async_host_bytes(), 8 << 20)
        handle = saver.save_async(state, self.path)
        y = w @ w  # the forward pass reads the weights while the save streams them
        handle.wait_staged()
        w.add_(1.0)  # the optimizer step: after wait_staged, not in the checkpoint
        handle.wait()
        torch.cuda.synchronize()
        self.assertTrue(torch.isfinite(y).all())
        self.assertEqual(saver.staging_bytes(), 8 << 20)
        self.assertTrue(torch.equal(sc.read(self.path)["w"], before))
        back = torch.zeros_like(w)
        request = sc.StateDict()
        request.add(sc.ShardedParam(spec, 1, 0, 0, 0, shard=back))
        sc.load_into(self.path, request)
        self.assertTrue(torch.equal(back.cpu(), before))


if __name__ == "__main__":
    unittest.main()
