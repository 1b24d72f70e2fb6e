// Tests for memory the library does not own or cannot touch: the emulated device (whose memory the
// host cannot read: any access outside its copy engine crashes), the pinned staging pool and its
// overlap of copies with writes, saves that allocate no device memory, and loads in place that
// allocate nothing. Async saves are in async_test.cpp.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "test_support.hpp"
#include "test_model.hpp"
#include "recording_engine.hpp"
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::host_mismatches;
using testing_support::CountingShard;
using testing_support::Recording;
using testing_support::tiny_model;
using testing_support::error_of;
using testing_support::file_bytes;
using testing_support::ScratchDir;

namespace {

// Host memory seen through a CopyEngine: copies it out and in (tests only).
std::vector<float> read_device(CopyEngine& engine, TensorView device) {
  std::vector<float> out(static_cast<std::size_t>(device.shape().elements()));
  engine.copy_to_host(device, MutTensorView::unchecked(out.data(), DType::f32, device.shape()));
  engine.wait(engine.fence());
  return out;
}

}  // namespace

// Resident pages of this process, from /proc/self/statm.
std::int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<std::int64_t>(::sysconf(_SC_PAGESIZE));
}

// Pinned host memory is backed when it is handed out: a copy into it never waits for the kernel to
// find and zero pages (the first async save of a Saver would, otherwise). Checked where mlock cannot
// lock it (mlock would fault the pages in itself): in a child that may lock nothing (as root, after
// giving up root, which ignores the limit).
// The device maker for one test: put in place when made, the one before put back when it ends.
class DeviceMakerForTest {
 public:
  explicit DeviceMakerForTest(DeviceEngineMaker maker) : before_(set_device_engine_maker(std::move(maker))) {}
  DeviceMakerForTest(const DeviceMakerForTest&) = delete;
  DeviceMakerForTest& operator=(const DeviceMakerForTest&) = delete;
  ~DeviceMakerForTest() { (void)set_device_engine_maker(std::move(before_)); }

 private:
  DeviceEngineMaker before_;
};

TEST(LockedMemory, EveryPageIsBackedWhenItIsAllocatedEvenWhereItCannotBeLocked) {
  constexpr std::int64_t bytes = 64 << 20;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const rlimit none{0, 0};
    if (::setrlimit(RLIMIT_MEMLOCK, &none) != 0) ::_exit(3);
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(4);
    const std::int64_t before = resident_bytes();
    SharedBuffer b = allocate_locked(DType::u8, Extents{bytes});
    const std::int64_t grew = resident_bytes() - before;
    ::_exit(grew >= bytes * 9 / 10 && b.bytes() == static_cast<std::size_t>(bytes) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the pages were not backed; 3, 4: the child could not drop its limits";
}

TEST(EmulatedDevice, HostAccessToDeviceMemoryCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto device = std::make_shared<EmulatedDevice>();
  SharedBuffer b = device->allocate_device(DType::f32, {4});
  EXPECT_DEATH(
      {
        volatile float x = *reinterpret_cast<const float*>(b.view().data());
        (void)x;
      },
      "");
  // The typed way in is refused, not crashed.
  EXPECT_EQ(error_of([&] { (void)b.view().as<float>(); }).code(), Errc::invalid_argument);
  EXPECT_EQ(error_of([&] { (void)materialize(b.view()); }).code(), Errc::invalid_argument);
}

TEST(EmulatedDevice, CopiesRoundTripInStreamOrderAndAreCounted) {
  const auto device = std::make_shared<EmulatedDevice>(3);
  SharedBuffer d = device->allocate_device(DType::f32, {2, 3});
  EXPECT_EQ(d.space(), MemorySpace::on_device(3));
  std::vector<float> in{1, 2, 3, 4, 5, 6};
  device->copy_to_device(TensorView::unchecked(in.data(), DType::f32, {2, 3}), d.mut_view());
  device->zero(d.mut_view().slice_rows(1, 2));  // after the copy, on the same stream
  EXPECT_EQ(read_device(*device, d.view()), (std::vector<float>{1, 2, 3, 0, 0, 0}));
  const EngineStats s = device->stats();
  EXPECT_EQ(s.device_allocations, 1u);
  EXPECT_EQ(s.copies_to_device, 1u);
  EXPECT_EQ(s.copies_to_host, 1u);
  EXPECT_EQ(s.zero_fills, 1u);
  // Copies between the wrong spaces, or of different sizes, are refused.
  EXPECT_EQ(error_of([&] { device->copy_to_device(d.view(), d.mut_view()); }).code(), Errc::invalid_argument);
  EXPECT_EQ(error_of([&] { device->copy_to_host(d.view(), MutTensorView::unchecked(in.data(), DType::f32, {5})); }).code(),
            Errc::invalid_argument);
  const auto other = std::make_shared<EmulatedDevice>(4);
  EXPECT_EQ(error_of([&] { other->zero(d.mut_view()); }).code(), Errc::invalid_argument);
}

// A device that runs its stream only when waited for leaves work undone until a wait asks for it,
// and then runs exactly the work before the fence waited for.
TEST(EmulatedDevice, WhenWaitedRunsOnlyWhatAWaitAsksFor) {
  const auto device = std::make_shared<EmulatedDevice>(0, EmulatedDevice::Progress::when_waited);
  SharedBuffer d = device->allocate_device(DType::f32, {2, 3});
  std::vector<float> in{1, 2, 3, 4, 5, 6}, out(6, -1);
  device->copy_to_device(TensorView::unchecked(in.data(), DType::f32, {2, 3}), d.mut_view());
  const Fence copied = device->fence();
  device->copy_to_host(d.view(), MutTensorView::unchecked(out.data(), DType::f32, {2, 3}));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(device->stats().unfinished, 2u);
  device->wait(copied);
  EXPECT_EQ(device->stats().unfinished, 1u);
  EXPECT_EQ(out, std::vector<float>(6, -1));  // the copy back waits for a wait
  device->wait(device->fence());
  EXPECT_EQ(device->stats().unfinished, 0u);
  EXPECT_EQ(out, in);
}

TEST(StagingPool, BuffersAreAllocatedOnceAndFitWholeRows) {
  const auto device = std::make_shared<EmulatedDevice>();
  const auto pool = std::make_shared<StagingPool>(device, 4096, 2);
  EXPECT_EQ(device->stats().pinned_allocations, 2u);
  EXPECT_EQ(pool->bytes(), 8192u);
  std::vector<float> memory(100 * 2048);
  const TensorView like = TensorView::unchecked(memory.data(), DType::f32, {100, 10});  // 40-byte rows
  EXPECT_EQ(pool->rows_per_buffer(like), 102);
  EXPECT_EQ(pool->rows_of(1, like, 102).space(), MemorySpace::pinned());
  EXPECT_EQ(error_of([&] { (void)pool->rows_of(0, like, 103); }).code(), Errc::invalid_argument);
  const TensorView wide = TensorView::unchecked(memory.data(), DType::f32, {2, 2048});  // a row larger than a buffer
  EXPECT_EQ(error_of([&] { (void)pool->rows_per_buffer(wide); }).code(), Errc::invalid_argument);
}

// Device shards stream device -> pinned -> file through the saver's two buffers: the copy of the
// next buffer is enqueued before the current one is waited for and written.
TEST(DeviceSave, CopiesOverlapWritesThroughTwoReusedBuffers) {
  ScratchDir dir;
  const auto device = std::make_shared<EmulatedDevice>();
  const auto engine = std::make_shared<Recording>(*device);
  CountingShard t(*device);
  StateDict s = t.state();
  SoloGroup solo;
  Saver saver(solo, {.engine = engine, .staging_buffer_bytes = 512});  // 8 rows a buffer: 8 copies
  const auto pinned = device->stats().pinned_allocations;
  saver.save(s, dir / "a.h5");
  const std::vector<std::string> calls = engine->calls();
  ASSERT_GE(calls.size(), 3u);
  EXPECT_EQ(calls[0], "to_host");
  EXPECT_EQ(calls[1], "to_host");  // in flight while the first buffer is written
  EXPECT_EQ(calls[2], "wait");
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "to_host"), 8);
  // One wait per copy: before its buffer is reused (6), or at the end (2), and none more once the
  // save has drained the buffers.
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "wait"), 8);
  EXPECT_EQ(device->stats().pinned_allocations, pinned);  // the pool is reused, never grown
  EXPECT_TRUE(t.saved_in(dir / "a.h5"));
}

TEST(DeviceSave, TenSavesAllocateNoDeviceMemoryAndNoMorePinnedMemory) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 8, 1};
  const demo::Training adam{.adam = true};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const auto device = std::make_shared<EmulatedDevice>();
    demo::RankModel m = demo::build_rank(c, l, g.rank(), adam, {MemoryKind::device, device});
    Saver saver(g, {.engine = device, .staging_buffer_bytes = 16 << 10});
    const std::size_t free_before = device->free_device_memory();
    const EngineStats before = device->stats();
    for (int i = 0; i < 10; ++i) saver.save(m.state, dir / "a.h5");
    EXPECT_EQ(device->free_device_memory(), free_before);
    EXPECT_EQ(device->stats().device_allocations, before.device_allocations);
    EXPECT_EQ(device->stats().pinned_allocations, before.pinned_allocations);
    EXPECT_GT(device->stats().bytes_to_host, before.bytes_to_host);
  });
  EXPECT_EQ(host_mismatches(c, {1, 4, 4, 1}, dir / "a.h5", adam), 0);
}

// A save that fails once copies are on their way leaves no device work behind: the pool's buffers
// go back only once the engine is done with them (the next save or load may take the same pool).
TEST(DeviceSave, AFailedSaveWaitsForTheCopiesItStarted) {
  ScratchDir dir;
  const auto device = std::make_shared<EmulatedDevice>(0, EmulatedDevice::Progress::when_waited);
  const auto pool = std::make_shared<StagingPool>(device, 4096);
  StateDict state;
  // "a" first (items in key order): small rows, copied into the pool; "b": a row larger than a buffer
  state.add(ShardedTensor::of("a", device->allocate_device(DType::f32, {64, 4}), {64, 4}, {0, 0}));
  state.add(ShardedTensor::of("b", device->allocate_device(DType::f32, {1, 2048}), {1, 2048}, {0, 0}));
  const Error e = error_of([&] { save(state, dir / "a.h5", {.staging = pool}); });
  EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
  EXPECT_NE(std::string(e.what()).find("does not fit a staging buffer"), std::string::npos) << e.what();
  EXPECT_GT(device->stats().copies_to_host, 0u) << "the save began copying before it failed";
  EXPECT_EQ(device->stats().unfinished, 0u);
  EXPECT_FALSE(std::filesystem::exists(dir / "a.h5"));
}

TEST(DeviceSave, DeviceShardsWithoutAnEngineFailEveryRankAndWriteNothing) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 0, 1};
  std::vector<std::optional<Errc>> codes(2);
  const auto device = std::make_shared<EmulatedDevice>();
  const DeviceMakerForTest none(nullptr);  // a library without CUDA
  try {
    run_ranks(2, [&](ProcessGroup& g) {
      // Rank 1's shards live on the device, and its save has no engine to move them.
      const demo::ShardMemory where =
          g.rank() == 1 ? demo::ShardMemory{MemoryKind::device, device} : demo::ShardMemory{};
      demo::RankModel m = demo::build_rank(c, l, g.rank(), {}, where);
      try {
        save(m.state, dir / "a.h5", g);
      } catch (const Error& e) {
        codes[static_cast<std::size_t>(g.rank())] = e.code();
        EXPECT_NE(std::string(e.what()).find("give the save or load a StagingPool"), std::string::npos) << e.what();
      }
    });
  } catch (const Error&) {
  }
  for (const auto& code : codes) EXPECT_EQ(code, Errc::device);
  EXPECT_FALSE(std::filesystem::exists(dir / "a.h5"));
  EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(dir / "a.h5").parent_path()).empty());
}

TEST(LoadInPlace, FillsDeviceShardsThroughThePoolAndAllocatesNothing) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Training adam{.adam = true, .distributed = true};
  run_ranks(4, [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, {2, 1, 0, 2}, g.rank(), adam);
    save(m.state, dir / "a.h5", g);
  });
  const demo::Layout l{1, 3, 16, 1};  // another TP, GTP and alignment, padded shards
  std::atomic<std::int64_t> pad_rows{0}, zero_fills{0};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    // Its stream runs only what a wait asks for: the load must wait for everything it enqueued.
    const auto device = std::make_shared<EmulatedDevice>(0, EmulatedDevice::Progress::when_waited);
    const auto pool = std::make_shared<StagingPool>(device, 4096);
    StateDict model =
        demo::with_destinations(demo::request(c, l, g.rank(), adam), {MemoryKind::device, device});
    g.barrier();
    const BufferStats before = buffer_stats();
    const EngineStats engine_before = device->stats();
    const Values values = load_into(dir / "a.h5", model, g, {.staging = pool});
    g.barrier();
    // No rank allocates between the barriers, so the process-wide count is exact.
    const BufferStats after = buffer_stats();
    g.barrier();
    EXPECT_EQ(after.allocations, before.allocations);
    EXPECT_EQ(device->stats().device_allocations, engine_before.device_allocations);
    EXPECT_EQ(device->stats().pinned_allocations, engine_before.pinned_allocations);
    zero_fills += static_cast<std::int64_t>(device->stats().zero_fills - engine_before.zero_fills);
    EXPECT_EQ(device->stats().unfinished, 0u);
    const demo::Verification v = demo::verify(c, adam, g.rank(), model, values, device.get());
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    pad_rows += v.pad_rows;
  });
  EXPECT_GT(pad_rows.load(), 0);
  EXPECT_GT(zero_fills.load(), 0);  // the pad rows were zeroed on the device
}

// A load returns once all of its device work has landed, the zero fill of a padding-only shard
// included (the only work such a rank gives its engine): on a device that runs its stream only when
// waited for, nothing is left undone when load_into returns, and the shard reads back as zeros.
TEST(LoadInPlace, ReturnsOnceEveryDeviceWriteHasLanded) {
  ScratchDir dir;
  const ParamSpec spec{"w", {{"x", 10}}, {4}, TpAxis::rows, 1, {}};
  StateDict whole;
  ShardedParam plain{spec, 1, 0, {0, 0}, DType::f32};
  plain.shard = SharedBuffer::zeros(DType::f32, {10, 4});
  whole.add(plain);
  save(whole, dir / "a.h5");
  // GTP 4 at alignment 8: 8 rows per shard, rank 3 holds none of the 10.
  ShardedParam last{spec, 4, 8, {0, 3}, DType::f32};
  ASSERT_TRUE(plan_rank(last.spec, last.gtp, last.align, last.coord).padding_only);
  for (const auto progress : {EmulatedDevice::Progress::eager, EmulatedDevice::Progress::when_waited}) {
    const auto device = std::make_shared<EmulatedDevice>(0, progress);
    const auto pool = std::make_shared<StagingPool>(device, 4096);
    SharedBuffer shard = device->allocate_device(DType::f32, last.shard_shape());
    StateDict state;
    ShardedParam p = last;
    p.shard = shard;
    state.add(p);
    (void)load_into(dir / "a.h5", state, {.staging = pool});
    EXPECT_EQ(device->stats().unfinished, 0u);
    EXPECT_EQ(device->stats().zero_fills, 1u);
    HostBuffer back = HostBuffer::uninitialized(DType::f32, last.shard_shape());
    std::memset(back.mut_view().data(), 0xff, back.bytes());
    device->copy_to_host(shard.view(), back.mut_view());
    device->wait(device->fence());
    for (float v : back.view().as<float>()) ASSERT_EQ(v, 0.0f);
  }
}

// Shards on a device saved and loaded with no pool given: the library takes its engine for the
// device (device_engine, made by the device maker once) and a pool of it, and reuses the pool once a
// save or load has let it go; ranks that hold one at once get their own.
TEST(DeviceDefaults, SavesAndLoadsThroughTheLibrarysEngineForTheDevice) {
  ScratchDir dir;
  const auto c = tiny_model();
  const auto device = std::make_shared<EmulatedDevice>(3, EmulatedDevice::Progress::when_waited);
  int made = 0;
  const DeviceMakerForTest maker([&](int id) -> std::shared_ptr<CopyEngine> {
    ++made;
    return id == 3 ? device : nullptr;
  });
  const demo::Layout saved{2, 1, 0, 1}, loaded{1, 3, 16, 1};
  std::vector<demo::RankModel> models;
  for (int r = 0; r < saved.ranks(); ++r) models.push_back(demo::build_rank(c, saved, r, {}, {MemoryKind::device, device}));
  const std::uint64_t pinned_before = device->stats().pinned_allocations;
  const std::uint64_t to_host_before = device->stats().copies_to_host;
  run_ranks(saved.ranks(), [&](ProcessGroup& g) {
    g.barrier();  // both ranks hold a pool at once
    save(models[static_cast<std::size_t>(g.rank())].state, dir / "a.h5", g);
  });
  EXPECT_EQ(made, 1);
  EXPECT_GT(device->stats().copies_to_host, to_host_before);
  const std::uint64_t pinned = device->stats().pinned_allocations;
  EXPECT_GE(pinned - pinned_before, 2u) << "a pool of two buffers";
  EXPECT_LE(pinned - pinned_before, 4u) << "at most a pool per rank";
  const int last = loaded.ranks() - 1;  // holds pad rows
  for (int round = 0; round < 2; ++round) {
    StateDict model = demo::with_destinations(demo::request(c, loaded, last), {MemoryKind::device, device});
    const Values values = load_into(dir / "a.h5", model);
    EXPECT_EQ(device->stats().unfinished, 0u);
    const demo::Verification v = demo::verify(c, {}, last, model, values, device.get());
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    EXPECT_GT(v.pad_rows, 0);
  }
  EXPECT_EQ(device->stats().pinned_allocations, pinned) << "a pool let go is handed out again";
  EXPECT_EQ(made, 1);
  // held at once: two pools; let go: the same one again
  std::shared_ptr<StagingPool> a = device_staging(MemorySpace::on_device(3));
  const std::shared_ptr<StagingPool> b = device_staging(MemorySpace::on_device(3));
  EXPECT_NE(a.get(), b.get());
  EXPECT_EQ(&a->engine(), device.get());
  const StagingPool* const first = a.get();
  a.reset();
  EXPECT_EQ(device_staging(MemorySpace::on_device(3)).get(), first);
  // a device the maker cannot make, and host memory, are refused
  EXPECT_EQ(error_of([] { (void)device_engine(MemorySpace::on_device(5)); }).code(), Errc::device);
  EXPECT_EQ(error_of([] { (void)device_engine(MemorySpace::host()); }).code(), Errc::invalid_argument);
}

// With no device maker (a library built without CUDA), device memory with no pool is refused before
// anything is written, naming what to give.
TEST(DeviceDefaults, WithoutAMakerDeviceMemoryNeedsAPool) {
  ScratchDir dir;
  const auto c = tiny_model();
  demo::RankModel m = demo::build_rank(c, {1, 1, 0, 1}, 0);
  save(m.state, dir / "a.h5");
  const DeviceMakerForTest none(nullptr);
  const auto device = std::make_shared<EmulatedDevice>();
  StateDict model = demo::with_destinations(demo::request(c, {1, 1, 0, 1}, 0), {MemoryKind::device, device});
  const Error e = error_of([&] { (void)load_into(dir / "a.h5", model); });
  EXPECT_EQ(e.code(), Errc::device);
  EXPECT_NE(std::string(e.what()).find("give the save or load a StagingPool"), std::string::npos) << e.what();
  demo::RankModel on_device = demo::build_rank(c, {1, 1, 0, 1}, 0, {}, {MemoryKind::device, device});
  EXPECT_EQ(error_of([&] { save(on_device.state, dir / "b.h5"); }).code(), Errc::device);
  EXPECT_FALSE(std::filesystem::exists(dir / "b.h5"));
}

TEST(LoadInPlace, AReadOnlyBorrowCannotBeLoadedInto) {
  ScratchDir dir;
  SharedBuffer b = SharedBuffer::zeros(DType::f32, {4, 2});
  StateDict s;
  s.add(ShardedTensor::of("t", b, {4, 2}, {0, 0}));
  save(s, dir / "a.h5");
  const HostBuffer mine = HostBuffer::zeros(DType::f32, {4, 2});
  StateDict into;
  into.add(ShardedTensor::of("t", unchecked_borrow(mine.view()), {4, 2}, {0, 0}));
  EXPECT_EQ(error_of([&] { (void)load_into(dir / "a.h5", into); }).code(), Errc::invalid_argument);
}

// A pool cut from memory it is given allocates nothing: as many whole buffers as fit, in place.
TEST(StagingPool, CutFromOneAllocationAllocatesNothing) {
  const auto device = std::make_shared<EmulatedDevice>();
  SharedBuffer memory = device->allocate_pinned(DType::u8, {2 * 4096 + 100});
  const auto allocations = device->stats().pinned_allocations;
  StagingPool pool(device, memory, 4096);
  EXPECT_EQ(device->stats().pinned_allocations, allocations);
  EXPECT_EQ(pool.buffers(), 2);
  EXPECT_EQ(pool.bytes(), 8192u);
  EXPECT_EQ(pool.buffer(1).data(), memory.mut_view().data() + 4096);
  EXPECT_EQ(pool.buffer(0).space(), MemorySpace::pinned());
  EXPECT_EQ(error_of([&] { StagingPool(device, memory, 1 << 20); }).code(), Errc::invalid_argument);
  SharedBuffer on_device = device->allocate_device(DType::u8, {8192});
  EXPECT_EQ(error_of([&] { StagingPool(device, on_device, 4096); }).code(), Errc::invalid_argument);
}

// A staging pool shares its engine: the engine lives while the pool does, whoever made it.
TEST(StagingPool, KeepsItsEngineAlive) {
  std::weak_ptr<EmulatedDevice> seen;
  std::shared_ptr<StagingPool> pool;
  {
    const auto device = std::make_shared<EmulatedDevice>();
    seen = device;
    pool = std::make_shared<StagingPool>(device, 4096, 2);
  }
  EXPECT_FALSE(seen.expired());
  SharedBuffer d = pool->engine().allocate_device(DType::u8, {4096});
  pool->engine().copy_to_device(pool->buffer(0), d.mut_view());
  pool->engine().wait(pool->engine().fence());
  pool.reset();
  d = SharedBuffer();
  EXPECT_TRUE(seen.expired());
}
