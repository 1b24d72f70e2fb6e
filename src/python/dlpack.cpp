// DLPack in both directions: a producer's tensor as a SharedBuffer (shared ownership of the
// producer's memory, never a copy), and a library-owned buffer as an object torch and numpy import
// through __dlpack__. DLPack 0.6 (Debian's libdlpack-dev): the unversioned "dltensor" capsule, which
// every torch since 1.10 and numpy since 1.22 produce and take.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlpack/dlpack.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

import shardckpt;

#include "binding.hpp"

namespace shardckpt::python {
namespace {

constexpr const char* capsule_name = "dltensor";
constexpr const char* used_capsule_name = "used_dltensor";

struct DTypeCode {
  DType dtype;
  std::uint8_t code;
  std::uint8_t bits;
};
constexpr DTypeCode dtype_codes[] = {
    {DType::bf16, kDLBfloat, 16}, {DType::f16, kDLFloat, 16}, {DType::f32, kDLFloat, 32}, {DType::f64, kDLFloat, 64},
    {DType::i8, kDLInt, 8},       {DType::i16, kDLInt, 16},   {DType::i32, kDLInt, 32},   {DType::i64, kDLInt, 64},
    {DType::u8, kDLUInt, 8},      {DType::u16, kDLUInt, 16},  {DType::u32, kDLUInt, 32},  {DType::u64, kDLUInt, 64},
};

DType dtype_of(const DLDataType& t, std::string_view key) {
  for (const DTypeCode& c : dtype_codes)
    if (c.code == t.code && c.bits == t.bits && t.lanes == 1) return c.dtype;
  throw py::type_error(cat(key, ": a tensor of DLPack type (code ", int{t.code}, ", ", int{t.bits}, " bits, ",
                           t.lanes, " lanes), which shardckpt does not store (it stores bf16, f16, f32, f64 and "
                           "signed and unsigned integers of 8 to 64 bits)"));
}

DLDataType code_of(DType dtype) {
  for (const DTypeCode& c : dtype_codes)
    if (c.dtype == dtype) return {c.code, c.bits, 1};
  throw Error(Errc::internal, "a dtype without a DLPack code");
}

MemorySpace space_of(const DLDevice& device, std::string_view key) {
  switch (device.device_type) {
    case kDLCPU: return MemorySpace::host();
    case kDLCUDAHost: return MemorySpace::pinned();
    case kDLCUDA: return MemorySpace::on_device(device.device_id);
    default:
      throw py::value_error(cat(key, ": a tensor on DLPack device type ", int{device.device_type},
                                ", which shardckpt cannot reach (CPU, CUDA host and CUDA memory only)"));
  }
}

// The producer's tensor, kept until the last owner goes: the DLPack deleter returns it (with the
// GIL, which a numpy deleter needs; none once the interpreter is gone, when the memory is too).
class DlpackAllocation final : public Allocation {
 public:
  DlpackAllocation(DLManagedTensor* managed, void* data, std::size_t bytes, MemorySpace space)
      : Allocation(data, bytes, space), managed_(managed) {}
  DlpackAllocation(const DlpackAllocation&) = delete;
  DlpackAllocation& operator=(const DlpackAllocation&) = delete;
  ~DlpackAllocation() override {
    if (managed_->deleter == nullptr || !Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    managed_->deleter(managed_);
  }

 private:
  DLManagedTensor* managed_;
};

// A contiguous row-major tensor: no strides, or strides that a compact layout has (any stride on a
// dimension of size 1, which does not move).
bool contiguous(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  // No elements, no bytes: any strides describe them (torch exports some such tensors with strides
  // of 1 where a dense tensor of that shape would have others).
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] == 0) return true;
  std::int64_t expect = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expect) return false;
    expect *= t.shape[d];
  }
  return true;
}

// Takes over the capsule's tensor: renamed "used_dltensor", so that its own destructor leaves it to us.
DLManagedTensor* take_capsule(py::handle capsule, std::string_view key) {
  if (!PyCapsule_IsValid(capsule.ptr(), capsule_name))
    throw py::type_error(cat(key, ": __dlpack__ returned no unused \"dltensor\" capsule"));
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), capsule_name));
  if (managed == nullptr) throw py::error_already_set();
  if (PyCapsule_SetName(capsule.ptr(), used_capsule_name) != 0) throw py::error_already_set();
  return managed;
}

SharedBuffer buffer_of(DLManagedTensor* managed, std::string_view key) {
  // Until the allocation holds it, the tensor is returned on every error path.
  auto give_back = [managed] {
    if (managed->deleter) managed->deleter(managed);
  };
  std::shared_ptr<Allocation> memory;
  Extents shape;
  DType dtype{};
  try {
    const DLTensor& t = managed->dl_tensor;
    if (t.ndim < 0 || t.ndim > max_rank)
      throw py::value_error(cat(key, ": a tensor of ", t.ndim, " dims (shardckpt stores 0 to ", max_rank, ")"));
    if (!contiguous(t)) throw py::value_error(cat(key, ": a non-contiguous tensor (call .contiguous() first)"));
    dtype = dtype_of(t.dtype, key);
    // A 0-d tensor is its one element, which a view holds as shape [1].
    shape = t.ndim == 0 ? Extents{1}
                        : Extents(std::span<const std::int64_t>(t.shape, static_cast<std::size_t>(t.ndim)));
    const MemorySpace space = space_of(t.device, key);
    const auto bytes = static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
    if (t.data == nullptr && bytes > 0)
      throw py::value_error(cat(key, ": a tensor of ", bytes, " bytes whose data pointer is null (no memory)"));
    auto* data = static_cast<std::byte*>(t.data) + t.byte_offset;
    memory = std::make_shared<DlpackAllocation>(managed, data, bytes, space);
  } catch (...) {
    give_back();
    throw;
  }
  return SharedBuffer(std::move(memory), dtype, shape);
}

// What an exported buffer's capsule carries: the buffer (shared ownership) and the shape DLPack
// points to.
struct Exported {
  SharedBuffer buffer;
  std::vector<std::int64_t> shape;
  DLManagedTensor managed{};
};

void delete_exported(DLManagedTensor* managed) { delete static_cast<Exported*>(managed->manager_ctx); }

DLDevice device_of(MemorySpace space) {
  switch (space.kind) {
    case MemoryKind::host: return {kDLCPU, 0};
    case MemoryKind::pinned: return {kDLCUDAHost, 0};
    case MemoryKind::device: return {kDLCUDA, space.device};
  }
  return {kDLCPU, 0};
}

py::capsule capsule_of(const SharedBuffer& buffer, bool scalar) {
  auto exported = std::make_unique<Exported>();
  exported->buffer = buffer;
  if (!scalar) exported->shape = buffer.shape().to_vector();  // a scalar: 0 dims, its one element
  DLTensor& t = exported->managed.dl_tensor;
  // Read-only is not DLPack 0.6's to say: a consumer may write, which a buffer this process owns allows.
  SharedBuffer& owner = exported->buffer;
  t.data = owner.mut_view().data();
  t.device = device_of(buffer.space());
  t.ndim = static_cast<std::int32_t>(exported->shape.size());
  t.dtype = code_of(buffer.dtype());
  t.shape = exported->shape.empty() ? nullptr : exported->shape.data();
  t.strides = nullptr;
  t.byte_offset = 0;
  exported->managed.manager_ctx = exported.get();
  exported->managed.deleter = delete_exported;
  return dlpack_capsule(&exported.release()->managed);
}

// The Python face of a library-owned buffer; a scalar's buffer holds its one element as shape [1].
struct LibraryTensor {
  SharedBuffer buffer;
  bool scalar = false;

  std::vector<std::int64_t> shape() const {
    return scalar ? std::vector<std::int64_t>{} : buffer.shape().to_vector();
  }
};

// A torch DTensor (torch.distributed.tensor): its type's name, or what it answers to. Its
// __dlpack__, where it has one, is not the local shard's.
bool is_dtensor(py::handle tensor) {
  const std::string type = py::str(py::type::of(tensor).attr("__name__"));
  return type == "DTensor" ||
         (py::hasattr(tensor, "to_local") && py::hasattr(tensor, "placements") && py::hasattr(tensor, "device_mesh"));
}

}  // namespace
}  // namespace shardckpt::python

SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::python::LibraryTensor)

namespace shardckpt::python {

SharedBuffer buffer_from_dlpack(py::handle tensor, std::string_view key) {
  if (PyCapsule_CheckExact(tensor.ptr())) return buffer_of(take_capsule(tensor, key), key);
  if (is_dtensor(tensor))
    throw py::type_error(cat("key ", key, ": a DTensor: pass its local shard (t.to_local()) as a ShardedTensor at its "
                             "global offset, or save the state dict with shardckpt.save_state_dict"));
  if (!py::hasattr(tensor, "__dlpack__"))
    throw py::type_error(cat(key, ": a ", std::string(py::str(py::type::of(tensor).attr("__name__"))),
                             ", not a tensor with __dlpack__ (torch, numpy, JAX, CuPy)"));
  py::object capsule = tensor.attr("__dlpack__")();
  return buffer_of(take_capsule(capsule, key), key);
}

// A capsule's destructor: a capsule nobody consumed still owns its tensor.
static void delete_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, capsule_name)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, capsule_name));
  if (managed && managed->deleter) managed->deleter(managed);
}

py::capsule dlpack_capsule(DLManagedTensor* managed) {
  PyObject* capsule = PyCapsule_New(managed, capsule_name, delete_capsule);
  if (capsule == nullptr) {
    managed->deleter(managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

py::object tensor_object(SharedBuffer buffer, bool scalar) {
  return py::cast(LibraryTensor{std::move(buffer), scalar});
}

void bind_tensor(py::module_& m) {
  py::class_<LibraryTensor>(m, "Tensor", "A tensor shardckpt allocated; torch.from_dlpack takes it without a copy.")
      .def("__dlpack__", [](const LibraryTensor& t, py::object /*stream*/) { return capsule_of(t.buffer, t.scalar); },
           py::arg("stream") = py::none())
      .def("__dlpack_device__",
           [](const LibraryTensor& t) {
             const DLDevice d = device_of(t.buffer.space());
             return py::make_tuple(static_cast<int>(d.device_type), d.device_id);
           })
      .def_property_readonly("shape", [](const LibraryTensor& t) { return py::tuple(py::cast(t.shape())); })
      .def_property_readonly("dtype", [](const LibraryTensor& t) { return std::string(dtype_name(t.buffer.dtype())); });
}

}  // namespace shardckpt::python
