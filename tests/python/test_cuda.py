"""torch CUDA tensors through DLPack, on a GPU (scripts/gpu-check.sh runs this; without a CUDA device
for torch every test is skipped): a bounded async save streams the weights from CUDA memory while a
forward pass reads them, the optimizer step after wait_staged() is not saved, a load fills CUDA
tensors in place, and a state dict's load hands the library CUDA memory only (no host staging)."""
import os
import shutil
import tempfile
import unittest

import torch

import shardckpt as sc
from support import check_copy_back, copy_back_case, record_library_tensors


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

    def test_a_state_dict_load_fills_cuda_targets_on_their_device(self):
        """The adapter's copy-back policy on a GPU: a contiguous CUDA target of the stored dtype (bool: its
        uint8 view) goes to the library itself, through its device path; any other through a temporary
        on the target's device. No tensor of the load is staged in host memory."""
        saved, target = copy_back_case("cuda")
        sc.save_state_dict(saved, self.path)
        given = record_library_tensors(self)
        sc.load_state_dict(target, self.path)
        self.assertEqual([t.device.type for t in given], ["cuda"] * len(saved))
        check_copy_back(self, saved, target, given)

if __name__ == "__main__":
    unittest.main()
