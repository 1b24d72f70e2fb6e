// What touches a checkpoint, bound for Python: save, load_into, load, Saver and its async saves,
// verify, inspect and read. Each releases the GIL for as long as the library works; the process group
// takes it back for each of its Python calls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

import shardckpt;

#include "binding.hpp"

namespace shardckpt::python {

namespace {

using Path = std::filesystem::path;

IoMethod method_arg(const std::string& name) {
  if (name == "raw") return IoMethod::raw;
  if (name == "hyperslab") return IoMethod::hyperslab;
  throw py::value_error(cat("method ", name, ": raw or hyperslab"));
}

// Device tensors go through the library's engine and pool for their device (device_staging).
SaveOptions save_options(const std::string& method, bool checksums, bool follow_links = true) {
  SaveOptions o;
  o.method = method_arg(method);
  o.checksums = checksums;
  o.follow_links = follow_links;
  return o;
}

LoadOptions load_options(const std::string& method, bool verify_checksums,
                         bool bypass_page_cache, std::string expect_id, std::string refused = {}) {
  LoadOptions o;
  // A front end's refusal on this rank, voted on in the load's first exchange (LoadOptions::refused).
  o.refused = std::move(refused);
  o.method = method_arg(method);
  o.verify_checksums = verify_checksums;
  o.bypass_page_cache = bypass_page_cache;
  // The checkpoint the caller looked at (inspect's "checkpoint_id"): another save's file is Errc::replaced.
  o.expect_id = std::move(expect_id);
  return o;
}

// The group to run on: a Python group object, or this process alone.
struct GroupArg {
  std::unique_ptr<ProcessGroup> group;
  explicit GroupArg(py::handle g) : group(g.is_none() ? std::make_unique<SoloGroup>() : group_of(g)) {}
  ProcessGroup& get() { return *group; }
};

// The loaded tensors (the request's scalars as 0-d tensors) and values.
py::dict tensors_dict(LoadedState& loaded, const std::set<std::string, std::less<>>& scalars) {
  py::dict out;
  for (const std::string& key : loaded.keys()) {
    if (loaded.values().contains(key)) {
      out[value_text(key)] = python_value(loaded.value(key));
    } else {
      out[value_text(key)] = tensor_object(loaded.tensor(key), scalars.contains(key));
    }
  }
  return out;
}

// An async save as Python holds it: the save, its path, what this rank's state dict lost before it
// began (Resolved::gone: its wait raises that here) and whether anyone waited for its outcome.
struct Pending {
  AsyncSave save;
  std::string path;
  std::vector<std::string> gone;
  bool waited = false;

  void wait() {
    waited = true;
    py::gil_scoped_release nogil;
    try {
      save.wait();
    } catch (const Error&) {
      raise_gone(gone);
      throw;
    }
  }
};

struct PyAsyncSave {
  std::shared_ptr<Pending> pending;
};

// Set by close_savers: the interpreter is exiting, and a save begun now could outlive it.
bool exiting = false;

// A saver held for Python. An async save runs on the saver's thread and calls the process group's
// Python methods, taking the GIL; a thread that takes the GIL once the interpreter is finalizing is
// ended by pthread_exit, which unwinds through C++ frames that may not be unwound (SIGABRT:
// "terminate called without an active exception", "FATAL: exception not rethrown"). So every saver's
// thread ends before finalization: a saver goes without the GIL (its end waits for the save in
// flight, whose group needs the GIL), and at exit (atexit, while the interpreter still runs
// everything) close_savers closes every saver still alive, which lets its save finish. A closed
// saver refuses every call. A call that releases the GIL holds the saver for as long as it runs
// (use()), so that close() from another thread cannot free it under the call; the last holder then
// frees it, without the GIL.
class PySaver {
 public:
  PySaver() { live().insert(this); }
  PySaver(PySaver&& other) noexcept : held_(std::move(other.held_)), last_(std::move(other.last_)) {
    live().insert(this);
  }
  PySaver& operator=(PySaver&&) = delete;
  ~PySaver() {
    live().erase(this);
    close();
  }

  static std::set<PySaver*>& live() {
    static std::set<PySaver*> savers;  // touched with the GIL held only
    return savers;
  }

  void open(std::shared_ptr<Saver> saver) { held_ = std::move(saver); }
  std::shared_ptr<Saver> use() const {
    require(held_ != nullptr, Errc::invalid_argument,
            "this Saver is closed (by close(), or at interpreter exit): make a new one");
    return held_;
  }
  // The latest async save, reported at exit when it failed and nobody waited for it.
  void track(std::shared_ptr<Pending> pending) { last_ = std::move(pending); }
  const std::shared_ptr<Pending>& last() const { return last_; }

  // Ends the save in flight, if any, and frees the saver's memory and private group.
  void close() {
    std::shared_ptr<Saver> saver = std::move(held_);
    if (!saver) return;
    if (_Py_IsFinalizing()) {  // no thread state to release; close_savers ended every save already
      saver.reset();
      return;
    }
    py::gil_scoped_release nogil;
    saver.reset();
  }

 private:
  std::shared_ptr<Saver> held_;
  std::shared_ptr<Pending> last_;
};

// At interpreter exit (atexit): every saver still alive finishes its save in flight and closes, and
// a save that failed without anyone waiting for it says so on stderr.
void close_savers() {
  exiting = true;
  const std::vector<PySaver*> savers(PySaver::live().begin(), PySaver::live().end());
  for (PySaver* s : savers) {
    const std::shared_ptr<Pending> last = s->last();
    s->close();
    if (!last || last->waited) continue;
    try {
      last->wait();
    } catch (const std::exception& e) {
      py::module_::import("sys").attr("stderr").attr("write")(
          message_text(cat("shardckpt: an async save to ", last->path, " that nobody waited for failed at exit: ",
                           python_wording(e.what()), "\n")));
    }
  }
}

// A byte count from Python: an int from 0 to 2**64 - 1 (ValueError otherwise, naming `what`).
std::size_t byte_count(const py::int_& value, const char* what) {
  const unsigned long long n = PyLong_AsUnsignedLongLong(value.ptr());
  if (n == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(cat(what, " ", std::string(py::repr(value)), ": a number of bytes is 0 to 2**64 - 1"));
  }
  return static_cast<std::size_t>(n);
}

// An open checkpoint, as Python holds it: one reader (open_checkpoint: collective over a group, rank
// 0 checking the seal; the ranks' readers hold one checkpoint), from which inspect's report and
// every load through it come, so that a load's records, common values and tensors are one file's
// whatever another save puts at the path meanwhile. close() lets the file go (loads through it then
// refuse); the tensors a load mapped keep their pages either way.
class PyCheckpoint {
 public:
  explicit PyCheckpoint(std::shared_ptr<const CheckpointReader> reader) : reader_(std::move(reader)) {}
  const CheckpointReader& reader() const {
    require(reader_ != nullptr, Errc::invalid_argument, "this checkpoint was closed");
    return *reader_;
  }
  std::shared_ptr<const CheckpointReader> held() const {
    reader();
    return reader_;
  }
  void close() { reader_.reset(); }
  bool closed() const { return reader_ == nullptr; }

 private:
  std::shared_ptr<const CheckpointReader> reader_;
};

}  // namespace
}  // namespace shardckpt::python

SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::python::PyAsyncSave)
SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::python::PyCheckpoint)
SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::python::PySaver)

namespace shardckpt::python {
namespace {

py::dict verify_dict(const VerifyReport& r) {
  py::dict d;
  d["checksummed"] = r.checksummed;
  d["datasets"] = r.datasets;
  d["bytes"] = r.bytes;
  d["checksum_rows"] = r.checksum_rows;
  d["mismatches"] = r.mismatches;
  py::list problems;
  for (const std::string& p : r.problems) problems.append(message_text(p));
  d["problems"] = problems;
  return d;
}

py::dict inspect_dict(const InspectReport& r) {
  py::list tensors, params;
  for (const InspectReport::Tensor& t : r.tensors) {
    py::dict d;
    d["key"] = value_text(t.key);
    d["dtype"] = std::string(dtype_name(t.dtype));
    d["global_shape"] = py::tuple(py::cast(t.global_shape));
    tensors.append(d);
  }
  for (const ParamRecord& p : r.params) {
    py::dict rec;
    rec["key"] = value_text(p.key);
    rec["tp_axis"] = std::string(tp_axis_name(p.tp_axis));
    rec["trailing"] = p.trailing;
    py::list blocks;
    for (const Section& s : p.blocks) blocks.append(py::make_tuple(value_text(block_key(p.key, s.name)), s.rows));
    rec["blocks"] = blocks;
    py::list divisors;
    for (const TpDivisor& d : p.divisors) divisors.append(py::make_tuple(value_text(d.name), d.count));
    rec["divisors"] = divisors;
    params.append(rec);
  }
  py::dict out;
  out["format_version"] = r.format_version;
  out["checkpoint_id"] = value_text(r.checkpoint_id);
  out["checksummed"] = r.checksummed;
  out["tensors"] = tensors;
  out["params"] = params;
  out["common"] = python_values(r.common);
  return out;
}

void bind_saver_saves(py::class_<PySaver>& saver);

void bind_saver(py::module_& m) {
  py::class_<PyAsyncSave>(m, "AsyncSave",
                          "A save in the background: wait_staged() returns once its bytes have left the shards, "
                          "wait() returns its outcome or raises it.")
      .def("wait_staged",
           [](PyAsyncSave& s) {
             py::gil_scoped_release nogil;
             s.pending->save.wait_staged();
           })
      .def("staged", [](const PyAsyncSave& s) { return s.pending->save.staged(); })
      .def("wait", [](PyAsyncSave& s) { s.pending->wait(); })
      .def("done", [](const PyAsyncSave& s) { return s.pending->save.done(); });
  py::class_<PySaver> saver(m, "Saver", "Repeated (and async) saves of one rank; collective to make.");
  saver.def(py::init([](py::object group, std::optional<int> cuda_device, const py::int_& async_host_bytes,
                       bool check_unchanged, const py::int_& staging_buffer_bytes, bool reserve, bool follow_links) {
             SaverOptions o;
             o.save.follow_links = follow_links;
             o.async_host_bytes = byte_count(async_host_bytes, "async_host_bytes");
             o.check_unchanged = check_unchanged;
             o.reserve = reserve;
             o.staging_buffer_bytes = byte_count(staging_buffer_bytes, "staging_buffer_bytes");
             if (cuda_device) o.engine = device_engine(MemorySpace::on_device(*cuda_device));
             GroupArg g(group);
             PySaver s;
             {
               py::gil_scoped_release nogil;
               s.open(std::make_shared<Saver>(g.get(), std::move(o)));
             }
             return s;
           }),
           py::arg("group") = py::none(), py::arg("cuda_device") = py::none(), py::arg("async_host_bytes") = 0,
           py::arg("check_unchanged") = false, py::arg("staging_buffer_bytes") = StagingPool::default_buffer_bytes,
           py::arg("reserve") = true, py::arg("follow_links") = true);
  bind_saver_saves(saver);
  saver
      .def("close", &PySaver::close,
           "Ends the save in flight (if any) and frees the saver's memory and private group; a closed saver "
           "refuses every call. Every saver still open closes at interpreter exit.")
      .def(
          "reserve",
          [](const PySaver& s) {
            const std::shared_ptr<Saver> saver = s.use();
            py::gil_scoped_release nogil;
            saver->reserve();
          },
          "Allocates the budget and faults in its pages if the saver does not hold it yet (made with "
          "reserve=False); this rank alone.")
      .def("async_host_bytes", [](const PySaver& s) { return s.use()->async_host_bytes(); })
      .def("staging_bytes", [](const PySaver& s) { return s.use()->staging_bytes(); });
}

// Saver.save and Saver.save_async.
void bind_saver_saves(py::class_<PySaver>& saver) {
  saver
      .def("save",
           [](PySaver& s, const PyStateDict& state, const Path& path) {
             std::shared_ptr<Saver> saver = s.use();
             resolve(state).run([&](StateDict& st) {
               py::gil_scoped_release nogil;
               const std::shared_ptr<Saver> held = std::move(saver);  // dropped before the GIL is back
               held->save(st, path);
             });
           },
           py::arg("state"), py::arg("path"))
      // A rank whose bytes exceed the budget streams them from its shards after save_async returns.
      // Device memory does (torch's caching allocator keeps a freed block mapped: a shard changed too
      // early gives other bytes); host memory may not: Python code can free a host
      // tensor's memory at any time (resize_, storage resize_), and nothing in torch keeps it or
      // refuses that, so a save still reading it would read freed memory. So save_async returns once
      // the save has read every host byte (the caller waits for the writes of a streamed rank, not
      // for the sync and the commit; a budget that holds the rank stages it and returns at once).
      .def("save_async",
           [](PySaver& s, const PyStateDict& state, const Path& path) {
             std::shared_ptr<Saver> saver = s.use();
             require(!exiting && !_Py_IsFinalizing(), Errc::invalid_argument,
                     "save_async at interpreter exit: its thread could not run past the interpreter; call save()");
             Resolved r = resolve(state);
             auto pending = std::make_shared<Pending>();
             pending->path = path.string();
             pending->gone = std::move(r.gone);
             {
               py::gil_scoped_release nogil;
               const std::shared_ptr<Saver> held = std::move(saver);  // dropped before the GIL is back
               pending->save = held->save_async(r.state, path);
               if (r.host) pending->save.wait_staged();
             }
             s.track(pending);
             return PyAsyncSave{pending};
           },
           py::arg("state"), py::arg("path"));
}

void bind_tools(py::module_& m);

// The loaded tensors of `request` (its scalars as 0-d tensors) and the values.
py::dict loaded_dict(LoadedState& loaded, const PyStateDict& request) {
  std::set<std::string, std::less<>> scalars;
  for (const ShardedTensor& t : request.state.tensors())
    if (t.scalar()) scalars.insert(t.key);
  return tensors_dict(loaded, scalars);
}

void bind_checkpoint(py::module_& m) {
  py::class_<PyCheckpoint>(m, "Checkpoint")
      .def_property_readonly("path", [](const PyCheckpoint& c) { return c.reader().path(); })
      .def_property_readonly("checkpoint_id", [](const PyCheckpoint& c) { return c.reader().contents().id; })
      .def_property_readonly("closed", &PyCheckpoint::closed)
      // inspect's report of this open file (records, common values, tensors, their dtypes and shapes).
      .def("inspect",
           [](const PyCheckpoint& c) {
             const std::shared_ptr<const CheckpointReader> reader = c.held();
             std::optional<InspectReport> report;
             {
               py::gil_scoped_release nogil;
               report.emplace(inspect_checkpoint(*reader));
             }
             return inspect_dict(*report);
           })
      .def("load_into",
           [](const PyCheckpoint& c, PyStateDict& state, py::object group, const std::string& method,
              bool verify_checksums, bool bypass_page_cache, std::string refused) {
             const std::shared_ptr<const CheckpointReader> reader = c.held();
             LoadOptions o = load_options(method, verify_checksums, bypass_page_cache, {}, std::move(refused));
             GroupArg g(group);
             const Values values = resolve(state).run([&](StateDict& st) {
               py::gil_scoped_release nogil;
               return load_into(*reader, st, g.get(), std::move(o));
             });
             return python_values(values);
           },
           py::arg("state"), py::arg("group") = py::none(), py::arg("method") = "raw",
           py::arg("verify_checksums") = true, py::arg("bypass_page_cache") = false, py::arg("refused") = "")
      .def("load",
           [](const PyCheckpoint& c, const PyStateDict& request, py::object group, const std::string& method,
              bool verify_checksums, bool map, std::string refused) {
             const std::shared_ptr<const CheckpointReader> reader = c.held();
             LoadOptions o = load_options(method, verify_checksums, false, {}, std::move(refused));
             o.map = map;
             GroupArg g(group);
             std::optional<LoadedState> loaded;
             {
               py::gil_scoped_release nogil;
               loaded.emplace(load(*reader, request.state, g.get(), std::move(o)));
             }
             return loaded_dict(*loaded, request);
           },
           py::arg("request"), py::arg("group") = py::none(), py::arg("method") = "raw",
           py::arg("verify_checksums") = true, py::arg("map") = true, py::arg("refused") = "")
      .def("close", &PyCheckpoint::close);
  m.def(
      "open",
      [](const Path& path, py::object group) {
        GroupArg g(group);
        std::shared_ptr<const CheckpointReader> reader;
        {
          py::gil_scoped_release nogil;
          reader = open_checkpoint(path, g.get());
        }
        return PyCheckpoint(std::move(reader));
      },
      py::arg("path"), py::arg("group") = py::none());
}

}  // namespace

void bind_io(py::module_& m) {
  // `refused`: this rank's refusal of its input, found by a front end before the call (its message);
  // the call's first exchange carries it, so that every rank fails at once (SaveOptions::refused).
  m.def("save",
        [](const PyStateDict& state, const Path& path, py::object group, const std::string& method, bool checksums,
           bool follow_links, std::string refused) {
          SaveOptions o = save_options(method, checksums, follow_links);
          o.refused = std::move(refused);
          GroupArg g(group);
          resolve(state).run([&](StateDict& st) {
            py::gil_scoped_release nogil;
            save(st, path, g.get(), std::move(o));
          });
        },
        py::arg("state"), py::arg("path"), py::arg("group") = py::none(), py::arg("method") = "raw",
        py::arg("checksums") = true, py::arg("follow_links") = true, py::arg("refused") = "");
  m.def("load_into",
        [](const Path& path, PyStateDict& state, py::object group, const std::string& method, bool verify_checksums,
           bool bypass_page_cache, std::string expect_id, std::string refused) {
          LoadOptions o = load_options(method, verify_checksums, bypass_page_cache, std::move(expect_id), std::move(refused));
          GroupArg g(group);
          const Values values = resolve(state).run([&](StateDict& st) {
            py::gil_scoped_release nogil;
            return load_into(path, st, g.get(), std::move(o));
          });
          return python_values(values);
        },
        py::arg("path"), py::arg("state"), py::arg("group") = py::none(), py::arg("method") = "raw",
        py::arg("verify_checksums") = true, py::arg("bypass_page_cache") = false, py::arg("expect_id") = "",
        py::arg("refused") = "");
  m.def("load",
        [](const Path& path, const PyStateDict& request, py::object group, const std::string& method,
           bool verify_checksums, bool map, std::string expect_id, std::string refused) {
          LoadOptions o = load_options(method, verify_checksums, false, std::move(expect_id), std::move(refused));
          o.map = map;
          GroupArg g(group);
          std::optional<LoadedState> loaded;
          {
            py::gil_scoped_release nogil;
            loaded.emplace(load(path, request.state, g.get(), std::move(o)));
          }
          return loaded_dict(*loaded, request);
        },
        py::arg("path"), py::arg("request"), py::arg("group") = py::none(), py::arg("method") = "raw",
        py::arg("verify_checksums") = true, py::arg("map") = true, py::arg("expect_id") = "", py::arg("refused") = "");
  bind_checkpoint(m);
  m.def("read",
        [](const Path& path, std::int64_t tp, std::int64_t tp_rank, bool map) {
          std::optional<ReadAll> read;
          {
            py::gil_scoped_release nogil;
            read.emplace(read_all(path, LoadLayout{.tp = tp, .coord = {tp_rank, 0}}, {.map = map}));
          }
          return tensors_dict(read->loaded, read->scalars);
        },
        py::arg("path"), py::arg("tp") = 1, py::arg("tp_rank") = 0, py::arg("map") = true);
  bind_tools(m);
  bind_saver(m);
  py::module_::import("atexit").attr("register")(py::cpp_function(&close_savers));
}

namespace {

// verify, inspect and adopt.
void bind_tools(py::module_& m) {
  // The CLI's answer (src/cli/verify.cpp): verified when the checkpoint is checksummed and every row
  // matches; a checkpoint without checksums is not verified (the CLI exits 1 for it).
  m.def("verify", [](const Path& path) {
    VerifyReport report;
    {
      py::gil_scoped_release nogil;
      report = verify_checkpoint(CheckpointReader(path));
    }
    require(report.checksummed, Errc::invalid_argument, path.string(),
            ": no checksums (saved with checksums=False, or written before checksums existed): nothing verified");
    if (report.mismatches > 0) {
      std::string problems;
      for (const std::string& p : report.problems) problems += cat(problems.empty() ? "" : "; ", p);
      throw Error(Errc::corrupt, cat(path.string(), ": ", report.mismatches,
                                     " checksummed rows differ from their checksums: ", problems));
    }
    return verify_dict(report);
  });
  m.def("inspect", [](const Path& path) {
    std::optional<InspectReport> report;
    {
      py::gil_scoped_release nogil;
      report.emplace(inspect_checkpoint(CheckpointReader(path)));
    }
    return inspect_dict(*report);
  });
  // The library's adopt (src/storage/adopt.cpp), as `shardckpt adopt` calls it: the records come as
  // the JSON text the CLI reads (parse_records checks it), the common values as a dict.
  m.def("adopt",
        [](const Path& source, const Path& out, const std::string& records, const py::dict& common) {
          const std::vector<ParamRecord> parsed = parse_records(records);
          Values values;
          for (const auto& [k, v] : common) {
            std::string key = utf8_text(k, "key");
            CommonValue value = common_value(v, key);
            values.emplace(std::move(key), std::move(value));
          }
          AdoptReport r;
          {
            py::gil_scoped_release nogil;
            r = adopt(source, out, parsed, values);
          }
          py::dict d;
          d["tensors"] = r.tensors;
          d["params"] = r.params;
          d["fused"] = r.fused;
          d["bytes"] = r.bytes;
          return d;
        },
        py::arg("source"), py::arg("out"), py::arg("records"), py::arg("common"));
}

}  // namespace

}  // namespace shardckpt::python
