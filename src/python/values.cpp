// shardckpt._core: the library's errors and values in Python's words and types (binding.hpp).
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

py::str decoded(std::string_view text, const char* errors) {
  PyObject* s = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), errors);
  if (s == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

}  // namespace

py::str message_text(std::string_view text) { return decoded(text, "backslashreplace"); }

std::string python_wording(std::string text) {
  // What a library message says in C++ terms, where a Python caller can meet it, and the words of
  // the Python API for it.
  static constexpr std::pair<std::string_view, std::string_view> python_words[] = {
      {"a Saver with that device's CopyEngine", "a Saver made for that device (Saver(cuda_device=N))"},
      {"give the save or load a StagingPool of a CopyEngine of yours", "install a shardckpt built with CUDA"},
      {"give the Saver an MPI or thread group", "call Saver.save(), or give the Saver a TorchGroup over gloo"},
      {"AsyncSave::wait_staged()", "AsyncSave.wait_staged()"},
      {"SaverOptions::check_unchanged", "Saver(check_unchanged=True)"},
  };
  for (const auto& [cpp, python] : python_words)
    for (std::size_t at = text.find(cpp); at != std::string::npos; at = text.find(cpp, at + python.size()))
      text.replace(at, cpp.size(), python);
  return text;
}

py::str value_text(std::string_view text) { return decoded(text, "surrogateescape"); }

std::string utf8_text(py::handle text, std::string_view what) {
  if (!PyUnicode_Check(text.ptr()))
    throw py::type_error(cat(what, ": a str, not a ", std::string(py::str(py::type::of(text).attr("__name__")))));
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(text.ptr(), &size);
  if (utf8 != nullptr) return {utf8, static_cast<std::size_t>(size)};
  PyErr_Clear();
  throw py::value_error(cat(what, " ", std::string(py::repr(text)),
                            ": a str with a lone surrogate, which is no text (it has no UTF-8 form); "
                            "a checkpoint holds UTF-8 text only"));
}

CommonValue common_value(py::handle value, std::string_view key) {
  // bool is an int in Python; a flag saved as 0/1 reads back as an int, so say so up front.
  if (py::isinstance<py::bool_>(value)) return CommonValue{std::int64_t{value.cast<bool>()}};
  if (py::isinstance<py::int_>(value)) {
    try {
      return CommonValue{value.cast<std::int64_t>()};
    } catch (const py::cast_error&) {
      throw py::value_error(cat(key, ": an int outside int64"));
    }
  }
  if (py::isinstance<py::float_>(value)) return CommonValue{value.cast<double>()};
  if (py::isinstance<py::str>(value)) return CommonValue{utf8_text(value, cat("key ", key, ": the value"))};
  throw py::type_error(cat(key, ": a common value is an int, a float or a str, not a ",
                           std::string(py::str(py::type::of(value).attr("__name__")))));
}

py::object python_value(const CommonValue& value) {
  return std::visit(
      [](const auto& v) -> py::object {
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, std::string>) {
          return value_text(v);
        } else {
          return py::cast(v);
        }
      },
      value);
}

py::dict python_values(const Values& values) {
  py::dict out;
  for (const auto& [key, value] : values) out[value_text(key)] = python_value(value);
  return out;
}

}  // namespace shardckpt::python
