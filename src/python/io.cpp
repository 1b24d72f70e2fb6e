// What touches a checkpoint, bound for Python: save, load_into, load, Saver and its async saves,
// verify, inspect and read. Each releases the GIL for as long as the library works; the process group
// takes it back for each of its Python calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

import shardckpt;
#if SHARDCKPT_HAVE_CUDA
import shardckpt.cuda;
#endif

#include "binding.hpp"

namespace shardckpt::python {

// The CUDA engine of a device, one per device for the process, made on first use.
std::shared_ptr<CopyEngine> cuda_engine(int device) {
#if SHARDCKPT_HAVE_CUDA
  static std::mutex mutex;
  static std::map<int, std::shared_ptr<CopyEngine>> engines;
  const std::lock_guard lock(mutex);
  std::shared_ptr<CopyEngine>& engine = engines[device];
  if (!engine) engine = std::make_shared<CudaEngine>(device);
  return engine;
#else
  throw Error(Errc::device, cat("CUDA device ", device, ": this shardckpt was built without CUDA"));
#endif
}

std::shared_ptr<StagingPool> staging_for(MemorySpace space) {
  if (space.kind != MemoryKind::device) return nullptr;
  static std::mutex mutex;
  static std::map<int, std::shared_ptr<StagingPool>> pools;
  std::shared_ptr<CopyEngine> engine = cuda_engine(space.device);
  const std::lock_guard lock(mutex);
  std::shared_ptr<StagingPool>& pool = pools[space.device];
  if (!pool) pool = std::make_shared<StagingPool>(std::move(engine));
  return pool;
}

namespace {

using Path = std::filesystem::path;

// The device memory space of a state dict's entries, if any (one device per rank).
std::optional<MemorySpace> device_space(const StateDict& state) {
  for (const ShardedParam& p : state.params())
    if (p.shard && p.shard.space().kind == MemoryKind::device) return p.shard.space();
  for (const ShardedTensor& t : state.tensors())
    if (t.data && t.data.space().kind == MemoryKind::device) return t.data.space();
  return std::nullopt;
}

IoMethod method_arg(const std::string& name) {
  if (name == "raw") return IoMethod::raw;
  if (name == "hyperslab") return IoMethod::hyperslab;
  throw py::value_error(cat("method ", name, ": raw or hyperslab"));
}

SaveOptions save_options(const StateDict& state, const std::string& method, bool checksums) {
  SaveOptions o;
  o.method = method_arg(method);
  o.checksums = checksums;
  if (auto space = device_space(state)) o.staging = staging_for(*space);
  return o;
}

LoadOptions load_options(const StateDict& state, const std::string& method, bool verify_checksums,
                         bool bypass_page_cache) {
  LoadOptions o;
  o.method = method_arg(method);
  o.verify_checksums = verify_checksums;
  o.bypass_page_cache = bypass_page_cache;
  if (auto space = device_space(state)) o.staging = staging_for(*space);
  return o;
}

// The group to run on: a Python group object, or this process alone.
struct GroupArg {
  std::unique_ptr<ProcessGroup> group;
  explicit GroupArg(py::handle g) : group(g.is_none() ? std::make_unique<SoloGroup>() : group_of(g)) {}
  ProcessGroup& get() { return *group; }
};

py::dict tensors_dict(LoadedState& loaded) {
  py::dict out;
  for (const std::string& key : loaded.keys()) {
    if (loaded.values().contains(key)) {
      out[py::str(key)] = python_value(loaded.value(key));
    } else {
      out[py::str(key)] = tensor_object(loaded.tensor(key));
    }
  }
  return out;
}

// A saver, or an async save in flight, held for Python: it goes without the GIL, since its end
// waits for a background save whose process group needs the GIL.
template <class T>
struct ReleasedOnDestruction {
  std::unique_ptr<T> held;
  ReleasedOnDestruction() = default;
  ReleasedOnDestruction(ReleasedOnDestruction&&) = default;
  ~ReleasedOnDestruction() {
    if (_Py_IsFinalizing()) {  // the interpreter is going: no thread state to release
      held.reset();
      return;
    }
    py::gil_scoped_release nogil;
    held.reset();
  }
};
using PyAsyncSave = ReleasedOnDestruction<AsyncSave>;
using PySaver = ReleasedOnDestruction<Saver>;

py::dict verify_dict(const VerifyReport& r) {
  py::dict d;
  d["checksummed"] = r.checksummed;
  d["datasets"] = r.datasets;
  d["bytes"] = r.bytes;
  d["checksum_rows"] = r.checksum_rows;
  d["mismatches"] = r.mismatches;
  d["problems"] = r.problems;
  return d;
}

py::dict inspect_dict(const CheckpointReader& r) {
  py::list tensors, params;
  for (const Dataset& d : r.datasets()) {
    py::dict t;
    t["key"] = d.key;
    t["dtype"] = std::string(dtype_name(d.dtype));
    t["global_shape"] = py::tuple(py::cast(d.shape));
    tensors.append(t);
  }
  for (const ParamRecord& p : r.params()) {
    py::dict rec;
    rec["key"] = p.key;
    rec["tp_axis"] = std::string(tp_axis_name(p.tp_axis));
    rec["trailing"] = p.trailing;
    py::list blocks;
    for (const Section& s : p.blocks) blocks.append(py::make_tuple(block_key(p.key, s.name), s.rows));
    rec["blocks"] = blocks;
    py::list divisors;
    for (const TpDivisor& d : p.divisors) divisors.append(py::make_tuple(d.name, d.count));
    rec["divisors"] = divisors;
    params.append(rec);
  }
  py::dict out;
  out["format_version"] = r.version();
  out["checkpoint_id"] = r.contents().id;
  out["checksummed"] = r.checksummed();
  out["tensors"] = tensors;
  out["params"] = params;
  out["common"] = python_values(r.contents().common);
  return out;
}

void bind_saver(py::module_& m) {
  py::class_<PyAsyncSave>(m, "AsyncSave",
                          "A save in the background: wait_staged() returns once its bytes have left the shards, "
                          "wait() returns its outcome or raises it.")
      .def("wait_staged",
           [](PyAsyncSave& s) {
             py::gil_scoped_release nogil;
             s.held->wait_staged();
           })
      .def("staged", [](const PyAsyncSave& s) { return s.held->staged(); })
      .def("wait",
           [](PyAsyncSave& s) {
             py::gil_scoped_release nogil;
             s.held->wait();
           })
      .def("done", [](const PyAsyncSave& s) { return s.held->done(); });
  py::class_<PySaver>(m, "Saver", "Repeated (and async) saves of one rank; collective to make.")
      .def(py::init([](py::object group, std::optional<int> cuda_device, std::size_t async_host_bytes,
                       bool check_unchanged, std::size_t staging_buffer_bytes) {
             SaverOptions o;
             o.async_host_bytes = async_host_bytes;
             o.check_unchanged = check_unchanged;
             o.staging_buffer_bytes = staging_buffer_bytes;
             if (cuda_device) o.engine = cuda_engine(*cuda_device);
             GroupArg g(group);
             PySaver s;
             {
               py::gil_scoped_release nogil;
               s.held = std::make_unique<Saver>(g.get(), std::move(o));
             }
             return s;
           }),
           py::arg("group") = py::none(), py::arg("cuda_device") = py::none(), py::arg("async_host_bytes") = 0,
           py::arg("check_unchanged") = false, py::arg("staging_buffer_bytes") = StagingPool::default_buffer_bytes)
      .def("save",
           [](PySaver& s, const PyStateDict& state, const Path& path) {
             py::gil_scoped_release nogil;
             s.held->save(state.state, path);
           },
           py::arg("state"), py::arg("path"))
      .def("save_async",
           [](PySaver& s, const PyStateDict& state, const Path& path) {
             PyAsyncSave out;
             py::gil_scoped_release nogil;
             out.held = std::make_unique<AsyncSave>(s.held->save_async(state.state, path));
             return out;
           },
           py::arg("state"), py::arg("path"))
      .def("async_host_bytes", [](const PySaver& s) { return s.held->async_host_bytes(); })
      .def("staging_bytes", [](const PySaver& s) { return s.held->staging_bytes(); });
}

}  // namespace

void bind_io(py::module_& m) {
  m.def("save",
        [](const PyStateDict& state, const Path& path, py::object group, const std::string& method, bool checksums) {
          SaveOptions o = save_options(state.state, method, checksums);
          GroupArg g(group);
          py::gil_scoped_release nogil;
          save(state.state, path, g.get(), std::move(o));
        },
        py::arg("state"), py::arg("path"), py::arg("group") = py::none(), py::arg("method") = "raw",
        py::arg("checksums") = true);
  m.def("load_into",
        [](const Path& path, PyStateDict& state, py::object group, const std::string& method, bool verify_checksums,
           bool bypass_page_cache) {
          LoadOptions o = load_options(state.state, method, verify_checksums, bypass_page_cache);
          GroupArg g(group);
          Values values;
          {
            py::gil_scoped_release nogil;
            values = load_into(path, state.state, g.get(), std::move(o));
          }
          return python_values(values);
        },
        py::arg("path"), py::arg("state"), py::arg("group") = py::none(), py::arg("method") = "raw",
        py::arg("verify_checksums") = true, py::arg("bypass_page_cache") = false);
  m.def("load",
        [](const Path& path, const PyStateDict& request, py::object group, const std::string& method,
           bool verify_checksums) {
          LoadOptions o = load_options(request.state, method, verify_checksums, false);
          GroupArg g(group);
          std::optional<LoadedState> loaded;
          {
            py::gil_scoped_release nogil;
            loaded.emplace(load(path, request.state, g.get(), std::move(o)));
          }
          return tensors_dict(*loaded);
        },
        py::arg("path"), py::arg("request"), py::arg("group") = py::none(), py::arg("method") = "raw",
        py::arg("verify_checksums") = true);
  m.def("read",
        [](const Path& path, std::int64_t tp, std::int64_t tp_rank) {
          std::optional<LoadedState> loaded;
          {
            py::gil_scoped_release nogil;
            const CheckpointReader reader(path);
            const StateDict request = request_all(reader, LoadLayout{.tp = tp, .coord = {tp_rank, 0}});
            loaded.emplace(load(reader, request));
          }
          return tensors_dict(*loaded);
        },
        py::arg("path"), py::arg("tp") = 1, py::arg("tp_rank") = 0);
  m.def("verify", [](const Path& path) {
    VerifyReport report;
    {
      py::gil_scoped_release nogil;
      report = verify_checkpoint(CheckpointReader(path));
    }
    return verify_dict(report);
  });
  m.def("inspect", [](const Path& path) {
    std::optional<CheckpointReader> reader;
    {
      py::gil_scoped_release nogil;
      reader.emplace(path);
      (void)reader->params();
      (void)reader->datasets();
    }
    return inspect_dict(*reader);
  });
  bind_saver(m);
}

}  // namespace shardckpt::python
