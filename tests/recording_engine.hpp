// A CopyEngine for the suites that check how a save moves device bytes (include after the standard
// headers and the modules): it forwards every call to a real engine, records the order of its calls
// beside notes the test adds (writes, the caller's progress), and can fail one copy on purpose.
#pragma once
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

}  // namespace testing_support
