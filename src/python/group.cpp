// A process group whose collectives are a Python object's methods (shardckpt.TorchGroup over
// torch.distributed, or any object with the same methods). The library calls it with the GIL
// released; every call here takes the GIL for as long as the Python method runs. Rows move in place:
// the object gets a DLPack view of the rows as bytes and fills the other members' shares itself.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

import shardckpt;

#include "binding.hpp"

namespace shardckpt::python {
namespace {

// A view lent to Python for the length of one call: its capsule's deleter frees only the shape.
struct Lent {
  std::int64_t bytes = 0;
  DLManagedTensor managed{};
};

py::capsule lend_bytes(MutTensorView rows) {
  auto lent = std::make_unique<Lent>();
  lent->bytes = static_cast<std::int64_t>(rows.bytes());
  DLTensor& t = lent->managed.dl_tensor;
  t.data = rows.data();
  const MemorySpace s = rows.space();
  t.device = s.kind == MemoryKind::device ? DLDevice{kDLCUDA, s.device} : DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = {kDLUInt, 8, 1};
  t.shape = &lent->bytes;
  lent->managed.manager_ctx = lent.get();
  lent->managed.deleter = [](DLManagedTensor* m) { delete static_cast<Lent*>(m->manager_ctx); };
  return dlpack_capsule(&lent.release()->managed);
}

std::vector<std::byte> bytes_of(py::handle b) {
  const std::string s = py::bytes(py::reinterpret_borrow<py::object>(b));
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

py::bytes python_bytes(std::span<const std::byte> b) {
  return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

class PythonGroup final : public ProcessGroup {
  // Runs a Python call with the GIL; what Python raises becomes the collective error the library
  // fails every rank with.
  template <class F>
  auto run(const char* what, F&& f) const {
    py::gil_scoped_acquire gil;
    try {
      return f();
    } catch (py::error_already_set& e) {
      throw Error(Errc::collective, cat("the process group's ", what, " failed: ", e.what()));
    } catch (const py::cast_error& e) {
      throw Error(Errc::collective, cat("the process group's ", what, " returned the wrong type: ", e.what()));
    }
  }
  template <class T>
  T call(const char* name) const {
    return run(name, [&] {
      if constexpr (std::is_void_v<T>) {
        group_.attr(name)();
      } else {
        return group_.attr(name)().template cast<T>();
      }
    });
  }


 public:
  explicit PythonGroup(py::object group) : group_(std::move(group)) {
    rank_ = call<int>("rank");
    size_ = call<int>("size");
  }
  PythonGroup(const PythonGroup&) = delete;
  PythonGroup& operator=(const PythonGroup&) = delete;
  ~PythonGroup() override {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    group_ = py::object();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override { call<void>("barrier"); }
  std::unique_ptr<ProcessGroup> split(int color, int key) override {
    return run("split", [&] { return std::make_unique<PythonGroup>(group_.attr("split")(color, key)); });
  }
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override {
    require_row_counts(rows, counts, size_);
    std::vector<std::int64_t> bytes;
    for (std::int64_t c : counts) bytes.push_back(c * static_cast<std::int64_t>(rows.row_bytes()));
    run("all_gather_rows", [&] {
      group_.attr("all_gather_rows")(lend_bytes(rows), bytes);
      return 0;
    });
  }
  std::vector<std::byte> broadcast(std::span<const std::byte> bytes, int root) override {
    require_root(root, size_);
    return run("broadcast_bytes", [&] { return bytes_of(group_.attr("broadcast_bytes")(python_bytes(bytes), root)); });
  }
  // A group moves host memory (gloo: device_index() is -1) or its own device's memory (NCCL).
  bool moves(MemorySpace space) const override {
    const int device = run("device_index", [&] { return group_.attr("device_index")().cast<int>(); });
    return space.host_accessible() ? device < 0 : device >= 0 && space == MemorySpace::on_device(device);
  }
  bool supports_background() const override {
    return run("supports_background", [&] { return group_.attr("supports_background")().cast<bool>(); });
  }

 protected:
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override {
    return run("all_gather_bytes", [&] {
      std::vector<std::vector<std::byte>> out;
      for (py::handle b : group_.attr("all_gather_bytes")(python_bytes(mine))) out.push_back(bytes_of(b));
      require(static_cast<int>(out.size()) == size_, Errc::collective, "all_gather_bytes returned ", out.size(),
              " members' bytes, not ", size_);
      return out;
    });
  }

 private:
  py::object group_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<ProcessGroup> group_of(py::handle group) {
  for (const char* name : {"rank", "size", "barrier", "split", "all_gather_rows", "broadcast_bytes",
                           "all_gather_bytes", "device_index", "supports_background"})
    if (!py::hasattr(group, name))
      throw py::type_error(cat("group: a ", std::string(py::str(py::type::of(group).attr("__name__"))),
                               " has no method ", name, " (pass a shardckpt.TorchGroup, or None for one process)"));
  return std::make_unique<PythonGroup>(py::reinterpret_borrow<py::object>(group));
}

}  // namespace shardckpt::python
