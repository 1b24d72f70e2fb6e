// A CopyEngine for the suites that check how a save moves device bytes (include after the standard
// headers and the modules): it forwards every call to a real engine, records the order of its calls
// beside notes the test adds (writes, the caller's progress), and can fail one copy on purpose.
#pragma once
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace testing_support {

class Recording final : public shardckpt::CopyEngine {
 public:
  // `fail_copy` > 0: the copy to the host of that number (counting from 1) throws Errc::device.
  explicit Recording(shardckpt::CopyEngine& inner, int fail_copy = 0) : inner_(inner), fail_copy_(fail_copy) {}
  std::string_view name() const noexcept override { return "recording"; }
  shardckpt::MemorySpace device() const noexcept override { return inner_.device(); }
  shardckpt::SharedBuffer allocate_pinned(shardckpt::DType dtype, shardckpt::Extents shape) override {
    return inner_.allocate_pinned(dtype, shape);
  }
  shardckpt::SharedBuffer allocate_device(shardckpt::DType dtype, shardckpt::Extents shape) override {
    return inner_.allocate_device(dtype, shape);
  }
  void copy_to_host(shardckpt::TensorView src, shardckpt::MutTensorView dst) override {
    if (note("to_host") == fail_copy_)
      throw shardckpt::Error(shardckpt::Errc::device, "the recording engine failed a copy on purpose");
    inner_.copy_to_host(src, dst);
  }
  void copy_to_device(shardckpt::TensorView src, shardckpt::MutTensorView dst) override {
    note("to_device");
    inner_.copy_to_device(src, dst);
  }
  void zero(shardckpt::MutTensorView dst) override {
    note("zero");
    inner_.zero(dst);
  }
  shardckpt::Fence fence() override { return inner_.fence(); }
  void wait(shardckpt::Fence f) override {
    note("wait");
    inner_.wait(f);
  }
  shardckpt::EngineStats stats() const override { return inner_.stats(); }
  std::vector<std::string> calls() {
    const std::lock_guard lock(mutex_);
    return calls_;
  }
  // Adds `what` to the record (from any thread); returns how many entries of that name it now holds.
  int note(std::string what) {
    const std::lock_guard lock(mutex_);
    int same = 0;
    for (const std::string& c : calls_) same += c == what;
    calls_.push_back(std::move(what));
    return same + 1;
  }

 private:
  shardckpt::CopyEngine& inner_;
  int fail_copy_;
  std::mutex mutex_;
  std::vector<std::string> calls_;
};

// What a device-save test saves: the 64 x 16 f32 tensor "t" in device memory, holding 0, 1, 2, ...
// (4 KiB), and whether a checkpoint holds it.
struct CountingShard {
  static constexpr std::int64_t rows = 64, cols = 16;
  std::vector<float> values = std::vector<float>(rows * cols);
  shardckpt::SharedBuffer shard;

  explicit CountingShard(shardckpt::CopyEngine& device) : shard(device.allocate_device(shardckpt::DType::f32, {rows, cols})) {
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
    device.copy_to_device(shardckpt::TensorView::unchecked(values.data(), shardckpt::DType::f32, {rows, cols}),
                          shard.mut_view());
    device.wait(device.fence());
  }
  shardckpt::StateDict state() {
    shardckpt::StateDict s;
    s.add(shardckpt::ShardedTensor::of("t", shard, {rows, cols}, {0, 0}));
    return s;
  }
  bool saved_in(const std::filesystem::path& file) const {
    const shardckpt::CheckpointReader reader(file);
    shardckpt::HostBuffer back = shardckpt::HostBuffer::uninitialized(shardckpt::DType::f32, {rows, cols});
    reader.read(reader.dataset("t"), shardckpt::whole_box(std::vector<std::int64_t>{rows, cols}), back.mut_view());
    return std::memcmp(back.view().data(), values.data(), back.bytes()) == 0;
  }
};

}  // namespace testing_support
