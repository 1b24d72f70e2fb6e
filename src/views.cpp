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

bf16 to_bf16(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) return {static_cast<std::uint16_t>((bits >> 16) | 0x40)};  // stay quiet NaN
  const std::uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);                       // nearest even
  return {static_cast<std::uint16_t>((bits + rounding) >> 16)};
}

float to_f32(bf16 value) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16); }

f16 to_f16(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000;
  const std::uint32_t abs = bits & 0x7FFFFFFF;
  if (abs > 0x7F800000) return {static_cast<std::uint16_t>(sign | 0x7E00)};   // NaN
  if (abs >= 0x477FF000) return {static_cast<std::uint16_t>(sign | 0x7C00)};  // rounds past 65504: inf
  if (abs < 0x38800000) {                                          // below the smallest normal half: subnormal or zero
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // 2^24: units of 2^-24
    return {static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled)))};
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const std::uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);
  return {static_cast<std::uint16_t>(sign | ((rounded - 0x38000000) >> 13))};
}

float to_f32(f16 value) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits & 0x8000) << 16;
  const std::uint32_t exp = (value.bits >> 10) & 0x1F;
  const std::uint32_t man = value.bits & 0x3FF;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000 | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}

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

void copy_into(TensorView from, MutTensorView to) {
  require(from.dtype() == to.dtype() && from.shape() == to.shape(), Errc::shape_mismatch,
          "copy between views of different dtype or shape (", dtype_name(from.dtype()), ", ", from.rows(), " rows -> ",
          dtype_name(to.dtype()), ", ", to.rows(), " rows)");
  if (!from.empty()) std::memmove(to.data(), from.data(), from.bytes());
}

}  // namespace shardckpt
