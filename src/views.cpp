module;
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
module shardckpt.views;

namespace shardckpt {
namespace {

std::atomic<std::uint64_t> materializations{0};
thread_local int forbid_depth = 0;

}  // namespace

HostBuffer::HostBuffer(DType dtype, Extents shape, bool zero) : dtype_(dtype), shape_(shape) {
  const std::size_t n = bytes();
  if (n == 0) return;
  data_ = static_cast<std::byte*>(::operator new(n, std::align_val_t{alignment}));
  if (zero) std::memset(data_, 0, n);
}

HostBuffer HostBuffer::zeros(DType dtype, Extents shape) { return HostBuffer(dtype, shape, true); }
HostBuffer HostBuffer::uninitialized(DType dtype, Extents shape) { return HostBuffer(dtype, shape, false); }

HostBuffer::~HostBuffer() {
  if (data_) ::operator delete(data_, std::align_val_t{alignment});
}

HostBuffer HostBuffer::deep_copy() const { return materialize(view()); }

HostBuffer materialize(TensorView view) { return materialize(std::span<const TensorView>(&view, 1)); }

HostBuffer materialize(std::span<const TensorView> parts) {
  require(!parts.empty(), Errc::invalid_argument, "materializing nothing");
  std::int64_t rows = 0;
  std::size_t bytes = 0;
  for (const TensorView& p : parts) {
    require(p.dtype() == parts[0].dtype() && p.shape().with_rows(0) == parts[0].shape().with_rows(0),
            Errc::shape_mismatch, "materializing views of different dtype or row shape");
    rows += p.rows();
    bytes += p.bytes();
  }
  require(forbid_depth == 0, Errc::materialization_forbidden, "materializing a ", dtype_name(parts[0].dtype()),
          " tensor of ", rows, " rows (", bytes, " bytes) while materialization is forbidden");
  materializations.fetch_add(1, std::memory_order_relaxed);
  HostBuffer out = HostBuffer::uninitialized(parts[0].dtype(), parts[0].shape().with_rows(rows));
  std::byte* dst = out.mut_view().data();
  for (const TensorView& p : parts) {
    if (!p.empty()) std::memcpy(dst, p.data(), p.bytes());
    dst += p.bytes();
  }
  return out;
}

std::uint64_t materialization_count() noexcept { return materializations.load(std::memory_order_relaxed); }

ForbidMaterialization::ForbidMaterialization() noexcept { ++forbid_depth; }
ForbidMaterialization::~ForbidMaterialization() { --forbid_depth; }
bool materialization_forbidden() noexcept { return forbid_depth > 0; }

}  // namespace shardckpt
