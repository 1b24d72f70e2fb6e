// The CUDA copy engine on a real device: copies and zero fills in stream order, device shards saved
// through a Saver's pinned pool (no device memory allocated by ten saves), loaded in place, saved and
// loaded through the library's engine for the device with no pool given, saved in
// the background while the caller overwrites them (staged whole, and streamed through a bounded budget
// after the trainer's stream). Without a CUDA device every test skips, and the
// suite exits 77 (skipped).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "test_support.hpp"
#include "test_model.hpp"
import shardckpt;
import shardckpt.cuda;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::tiny_model;

namespace {

// Why there is no CUDA device to test on ("" when there is one): a driver older than the toolkit
// says so here rather than passing for a machine without a GPU.
std::string no_gpu() {
  int n = 0;
  if (const cudaError_t rc = cudaGetDeviceCount(&n); rc != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(rc);
  }
  return n == 0 ? "no CUDA device" : "";
}

#define REQUIRE_GPU() \
  if (const std::string why = no_gpu(); !why.empty()) GTEST_SKIP() << why

}  // namespace

TEST(Cuda, CopiesAndZeroFillsRunInStreamOrder) {
  REQUIRE_GPU();
  const auto engine = std::make_shared<CudaEngine>(0);
  SharedBuffer d = engine->allocate_device(DType::f32, {2, 3});
  EXPECT_EQ(d.space(), MemorySpace::on_device(0));
  SharedBuffer typed = engine->allocate_pinned(DType::f32, {2, 3});
  const MutTensorView host = typed.mut_view();
  for (int i = 0; i < 6; ++i) host.as<float>()[static_cast<std::size_t>(i)] = static_cast<float>(i + 1);
  engine->copy_to_device(host, d.mut_view());
  engine->zero(d.mut_view().slice_rows(1, 2));
  std::vector<float> back(6, -1);
  engine->copy_to_host(d.view(), MutTensorView::unchecked(back.data(), DType::f32, {2, 3}));
  engine->wait(engine->fence());
  EXPECT_EQ(back, (std::vector<float>{1, 2, 3, 0, 0, 0}));
  EXPECT_THROW((void)d.view().as<float>(), Error);  // device bytes are not host memory
  EXPECT_THROW(engine->copy_to_device(d.view(), d.mut_view()), Error);
}

TEST(Cuda, DeviceShardsSaveWithoutDeviceMemoryAndLoadInPlace) {
  REQUIRE_GPU();
  testing_support::ScratchDir dir;
  const auto c = tiny_model();
  const demo::Training adam{.adam = true, .distributed = true};
  run_ranks(2, [&](ProcessGroup& g) {
    const auto engine = std::make_shared<CudaEngine>(0);
    const demo::ShardMemory device{MemoryKind::device, engine};
    demo::RankModel m = demo::build_rank(c, {1, 2, 8, 1}, g.rank(), adam, device);
    Saver saver(g, {.engine = engine, .staging_buffer_bytes = 64 << 10});
    saver.save(m.state, dir / "warm.h5");  // the CUDA context and the pool exist from here on
    g.barrier();
    const std::size_t free_before = engine->free_device_memory();
    for (int i = 0; i < 10; ++i) saver.save(m.state, dir / "a.h5");
    g.barrier();
    // Both ranks share device 0: neither allocates until both have read its free memory.
    EXPECT_EQ(engine->free_device_memory(), free_before);
    g.barrier();
    const demo::Layout other{2, 1, 0, 1};
    StateDict model = demo::with_destinations(demo::request(c, other, g.rank(), adam), device);
    const auto pool = std::make_shared<StagingPool>(engine, 64 << 10);
    const Values values = load_into(dir / "a.h5", model, g, {.staging = pool});
    const demo::Verification v = demo::verify(c, adam, g.rank(), model, values, engine.get());
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    EXPECT_GT(v.values, 0);
  });
}

// With no pool given, saves and loads of CUDA shards take the library's engine for the device (one
// per process) and a pool of it: what the Python binding and a plain load_into do.
TEST(Cuda, DeviceShardsSaveAndLoadThroughTheLibrarysEngineWithNoPoolGiven) {
  REQUIRE_GPU();
  testing_support::ScratchDir dir;
  const auto c = tiny_model();
  const std::shared_ptr<CopyEngine> engine = device_engine(MemorySpace::on_device(0));
  EXPECT_EQ(engine->name(), "cuda");
  EXPECT_EQ(device_engine(MemorySpace::on_device(0)).get(), engine.get());
  const demo::ShardMemory device{MemoryKind::device, engine};
  run_ranks(2, [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, {1, 2, 8, 1}, g.rank(), {}, device);
    save(m.state, dir / "a.h5", g);
    StateDict model = demo::with_destinations(demo::request(c, {2, 1, 0, 1}, g.rank()), device);
    const Values values = load_into(dir / "a.h5", model, g);
    const demo::Verification v = demo::verify(c, {}, g.rank(), model, values, engine.get());
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    EXPECT_GT(v.values, 0);
  });
  EXPECT_EQ(engine->stats().unfinished, 0u);
}

TEST(Cuda, AsyncSaveFromTheDeviceKeepsTheWeightsAsTheyWere) {
  REQUIRE_GPU();
  testing_support::ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 8, 1};
  run_ranks(2, [&](ProcessGroup& g) {
    const auto engine = std::make_shared<CudaEngine>(0);
    demo::RankModel m = demo::build_rank(c, l, g.rank(), {}, {MemoryKind::device, engine});
    Saver saver(g, {.engine = engine});
    AsyncSave pending = saver.save_async(m.state, dir / "a.h5");
    for (std::size_t i = 0; i < m.state.params().size(); ++i) engine->zero(m.state.mut_shard(i).mut_view());  // train on
    engine->wait(engine->fence());
    pending.wait();
  });
  run_ranks(2, [&](ProcessGroup& g) {
    StateDict model = demo::with_destinations(demo::request(c, {2, 1, 0, 1}, g.rank()));
    const Values values = load_into(dir / "a.h5", model, g);
    EXPECT_EQ(demo::verify(c, {}, g.rank(), model, values).mismatches, 0);
  });
}

// The bounded path on a GPU: the trainer's stream writes the weights, the engine follows it, and
// save_async returns before a byte is copied; the weights stream through a budget of 2 x 64 KiB
// while the trainer's stream runs on, and the optimizer step after wait_staged() is not saved.
TEST(Cuda, BoundedAsyncSaveFollowsTheTrainersStreamAndStreamsThroughTheBudget) {
  REQUIRE_GPU();
  testing_support::ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 8, 1};
  run_ranks(2, [&](ProcessGroup& g) {
    const auto engine = std::make_shared<CudaEngine>(0);
    demo::RankModel m = demo::build_rank(c, l, g.rank(), {.adam = true}, {MemoryKind::device, engine});
    cudaStream_t trainer = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking), cudaSuccess);
    Saver saver(g, {.engine = engine, .staging_buffer_bytes = 4 << 10, .check_unchanged = true});
    ASSERT_GT(static_cast<std::size_t>(m.shard_bytes), saver.async_host_bytes());
    const auto fill = [&](int byte) {
      for (std::size_t i = 0; i < m.state.params().size(); ++i)
        if (const MutTensorView shard = m.state.mut_shard(i).mut_view(); !shard.empty())
          ASSERT_EQ(cudaMemsetAsync(shard.data(), byte, shard.bytes(), trainer), cudaSuccess);
    };
    fill(0x3f);  // the step's weights, still being written on the trainer's stream
    engine->follow(trainer);
    AsyncSave pending = saver.save_async(m.state, dir / "a.h5");
    pending.wait_staged();
    fill(0);  // the optimizer step, after the save has read the weights
    pending.wait();
    ASSERT_EQ(cudaStreamSynchronize(trainer), cudaSuccess);
    cudaStreamDestroy(trainer);
    EXPECT_EQ(saver.staging_bytes(), std::size_t{8} << 10);
  });
  const CheckpointReader reader(dir / "a.h5");
  for (const Dataset& d : reader.datasets()) {
    HostBuffer back = HostBuffer::zeros(d.dtype, Extents(std::span<const std::int64_t>(d.shape)));
    reader.read(d, whole_box(d.shape), back.mut_view());
    const auto* bytes = back.view().data();
    EXPECT_TRUE(std::all_of(bytes, bytes + back.bytes(), [](std::byte b) { return b == std::byte{0x3f}; })) << d.key;
  }
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const auto& unit = *::testing::UnitTest::GetInstance();
  return rc == 0 && unit.skipped_test_count() == unit.test_to_run_count() ? 77 : rc;
}
