// shardckpt._core: a Python state dict's memory taken again from its tensors before each save and
// load (resolve), and what is said when it cannot be (raise_gone).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

import shardckpt;

#include "binding.hpp"

namespace shardckpt::python {

namespace {

// Takes `source`'s memory again for `ref`; an entry whose memory cannot be taken goes without, and
// `gone` says why.
void retake(TensorRef& ref, const py::object& source, const std::string& key, Resolved& out) {
  if (source.is_none()) return;
  try {
    ref = TensorRef(buffer_from_dlpack(source, key));
  } catch (py::error_already_set& e) {  // __dlpack__ raised: its type and message, without the traceback
    ref = {};
    const py::str text = py::str(e.value());
    const auto utf8 =
        py::reinterpret_steal<py::bytes>(PyUnicode_AsEncodedString(text.ptr(), "utf-8", "backslashreplace"));
    out.gone.push_back(cat(key, ": ", std::string(py::str(e.type().attr("__name__"))), ": ", std::string(utf8)));
  } catch (const py::builtin_exception& e) {
    ref = {};
    out.gone.push_back(e.what());
  } catch (const Error& e) {
    ref = {};
    out.gone.push_back(cat(key, ": ", e.what()));
  }
}

}  // namespace

Resolved resolve(const PyStateDict& s) {
  Resolved out{s.state, {}};
  for (std::size_t i = 0; i < out.state.params().size(); ++i) {
    TensorRef& shard = out.state.mut_shard(i);
    retake(shard, s.param_sources[i], out.state.params()[i].spec.key, out);
    out.host = out.host || (shard && shard.space().host_accessible());
  }
  for (std::size_t i = 0; i < out.state.tensors().size(); ++i) {
    TensorRef& data = out.state.mut_data(i);
    retake(data, s.tensor_sources[i], out.state.tensors()[i].key, out);
    out.host = out.host || (data && data.space().host_accessible());
  }
  return out;
}

void raise_gone(const std::vector<std::string>& gone) {
  if (gone.empty()) return;
  std::string text = "the memory of a tensor of this state dict changed since it was added, and is not a shard any "
                     "more: ";
  for (std::size_t i = 0; i < gone.size(); ++i) text += cat(i ? "; " : "", gone[i]);
  throw Error(Errc::shard_changed, text);
}

}  // namespace shardckpt::python
