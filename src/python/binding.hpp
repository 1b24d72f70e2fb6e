// The Python binding's own declarations, shared by its files (src/python/*.cpp). The binding turns
// Python objects into the library's types and back and calls the library: it holds no save or load
// logic of its own. Every file includes this after its standard headers and imports shardckpt.
#pragma once
#include <pybind11/pybind11.h>

#include <dlpack/dlpack.h>

#include <memory>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace shardckpt::python {

namespace py = pybind11;

// pybind11 2.10 hands a method of an object made by `Class.__new__(Class)`, whose __init__ never ran,
// raw memory in which no C++ object was ever constructed (pybind11 issue 6153): a segfault or garbage.
// Every class the extension binds loads its objects through constructed_caster (SHARDCKPT_CONSTRUCTED_ONLY
// below), which refuses such an object with a TypeError naming the class before any method runs.
void require_constructed(py::handle object, const std::type_info& type);

template <class T>
class constructed_caster : public py::detail::type_caster_base<T> {
 public:
  bool load(py::handle src, bool convert) {
    require_constructed(src, typeid(T));
    return py::detail::type_caster_base<T>::load(src, convert);
  }
};

// Text the library made, as a Python str. Messages name paths, which are bytes: one that is not
// UTF-8 shows its undecodable bytes as \xNN (printable, unlike a lone surrogate). Keys and values
// round-trip: undecodable bytes become lone surrogates, as os.fsdecode makes them.
py::str message_text(std::string_view text);
py::str value_text(std::string_view text);
// A library message with the C++ API's names it may hold (a Saver's CopyEngine, SaverOptions) put
// in the Python API's words (Saver(cuda_device=N), Saver(check_unchanged=True)): shardckpt.Error's text.
std::string python_wording(std::string text);
// A Python str as UTF-8 for the library; one that has none (a lone surrogate) is a ValueError that
// says what it is (`what`: "key", "key K: the value").
std::string utf8_text(py::handle text, std::string_view what);

// Tensor memory from any object with __dlpack__ (or a "dltensor" capsule): the buffer shares the
// ownership of the producer's tensor (the DLPack deleter runs when the last owner goes, with the GIL
// held). CPU memory is host memory, CUDA host memory pinned, CUDA memory device memory. A 0-d tensor
// is its one element (a buffer of shape [1]). A dtype the library lacks, or a torch DTensor, is
// TypeError; a non-contiguous tensor, too many dims or a null data pointer for a tensor of some bytes
// ValueError, each naming `key` (torch's __dlpack__ itself refuses a tensor whose storage was freed
// or shrunk under it).
SharedBuffer buffer_from_dlpack(py::handle tensor, std::string_view key);

// `managed` in an unused "dltensor" capsule, which runs its deleter unless a consumer took it (and
// runs it at once when no capsule can be made).
py::capsule dlpack_capsule(DLManagedTensor* managed);

// A library-owned buffer as a Python object with __dlpack__ and __dlpack_device__ (torch.from_dlpack
// and numpy.from_dlpack take it without copying); it shares the buffer's ownership. `scalar`: the
// buffer's one element as a 0-d tensor.
py::object tensor_object(SharedBuffer buffer, bool scalar = false);

// A process group over a Python object with the group protocol of shardckpt.TorchGroup (rank, size,
// barrier, all_gather_bytes, broadcast_bytes, all_gather_rows, split, device_index,
// supports_background). Its calls take the GIL; errors raised in Python become Errc::collective.
std::unique_ptr<ProcessGroup> group_of(py::handle group);

// A state dict and the Python objects its entries' memory came from (None for an entry without
// memory), in the order of state.params() and state.tensors(): each keeps its object alive while
// the state dict lives, and each save and load takes the memory again from it (resolve).
struct PyStateDict {
  StateDict state;
  std::vector<py::object> param_sources, tensor_sources;
};

// Errc::shard_changed naming each entry whose memory is gone and what happened to it (none: returns).
void raise_gone(const std::vector<std::string>& gone);

// What a save or a load hands the library: the state dict with each entry's memory taken again from
// its Python object, with the GIL, just before the library works. Python code may have freed, moved
// or reshaped a tensor's memory since it was added (torch's resize_, or a storage resized to 0 as
// FSDP frees a parameter): the library then gets the memory the tensor has now, and the shape it has
// now, which it checks as it checks any shard (shape_mismatch, dtype_mismatch, naming the key, on
// every rank). An entry whose memory cannot be taken any more goes without (every rank's save or
// load then fails on it: "no shard to save") and `gone` says why; run() raises that on this rank.
struct Resolved {
  StateDict state;
  std::vector<std::string> gone;
  bool host = false;  // an entry lies in host memory (or pinned host memory)

  // Returns `f(state)`; when it fails and an entry's memory is gone (which fails it), this rank's
  // error is raise_gone's.
  template <class F>
  decltype(auto) run(F&& f) {
    try {
      return f(state);
    } catch (const Error&) {
      raise_gone(gone);
      throw;
    }
  }
};
Resolved resolve(const PyStateDict& state);

void bind_layout(py::module_& m);
void bind_state(py::module_& m);
void bind_io(py::module_& m);

// A common value from a Python int, float or str (TypeError otherwise), and back.
CommonValue common_value(py::handle value, std::string_view key);
py::object python_value(const CommonValue& value);
py::dict python_values(const Values& values);

}  // namespace shardckpt::python

// Declares that objects of T load only once constructed (constructed_caster); at global scope, after
// T's definition and before its first use, in each file that uses T.
#define SHARDCKPT_CONSTRUCTED_ONLY(T)                                                    \
  namespace pybind11::detail {                                                           \
  template <>                                                                            \
  class type_caster<T> : public ::shardckpt::python::constructed_caster<T> {};           \
  }

SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::SsmDims)
SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::Section)
SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::TpDivisor)
SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::ParamSpec)
SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::python::PyStateDict)
