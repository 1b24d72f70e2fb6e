// The Python binding's own declarations, shared by its files (src/python/*.cpp). The binding turns
// Python objects into the library's types and back and calls the library: it holds no save or load
// logic of its own. Every file includes this after its standard headers and imports shardckpt.
#pragma once
#include <pybind11/pybind11.h>

#include <dlpack/dlpack.h>

#include <memory>
#include <string>
#include <string_view>

namespace shardckpt::python {

namespace py = pybind11;

// Tensor memory from any object with __dlpack__ (or a "dltensor" capsule): the buffer shares the
// ownership of the producer's tensor (the DLPack deleter runs when the last owner goes, with the GIL
// held). CPU memory is host memory, CUDA host memory pinned, CUDA memory device memory. A dtype the
// library lacks is TypeError, a non-contiguous tensor, a scalar or too many dims ValueError, each
// naming `key`.
SharedBuffer buffer_from_dlpack(py::handle tensor, std::string_view key);

// `managed` in an unused "dltensor" capsule, which runs its deleter unless a consumer took it (and
// runs it at once when no capsule can be made).
py::capsule dlpack_capsule(DLManagedTensor* managed);

// A library-owned buffer as a Python object with __dlpack__ and __dlpack_device__ (torch.from_dlpack
// and numpy.from_dlpack take it without copying); it shares the buffer's ownership.
py::object tensor_object(SharedBuffer buffer);

// A process group over a Python object with the group protocol of shardckpt.TorchGroup (rank, size,
// barrier, all_gather_bytes, broadcast_bytes, all_gather_rows, split, device_index,
// supports_background). Its calls take the GIL; errors raised in Python become Errc::collective.
std::unique_ptr<ProcessGroup> group_of(py::handle group);

// The CUDA staging pool of `space`'s device, made on first use (Errc::device without CUDA), or null
// for host memory.
std::shared_ptr<StagingPool> staging_for(MemorySpace space);

// A state dict and the Python objects its entries came from: each entry's memory is kept alive by
// its DLPack owner inside the state dict, and the objects themselves while the state dict lives.
struct PyStateDict {
  StateDict state;
  py::list objects;
};

void bind_layout(py::module_& m);
void bind_state(py::module_& m);
void bind_io(py::module_& m);

// A common value from a Python int, float or str (TypeError otherwise), and back.
CommonValue common_value(py::handle value, std::string_view key);
py::object python_value(const CommonValue& value);
py::dict python_values(const Values& values);

}  // namespace shardckpt::python
