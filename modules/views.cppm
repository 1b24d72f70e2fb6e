// shardckpt.views: who owns tensor memory, and how others look at it without owning it.
// HostBuffer owns (move-only, aligned, copied only by an explicit deep_copy); TensorView and
// MutTensorView look (tiny values, never allocate, never own, never become owners implicitly).
// Turning a view into a new owner is `materialize`, the one counted copy, which a save forbids
// with ForbidMaterialization. This module does no I/O.
module;
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>
export module shardckpt.views;
import shardckpt.core;

export namespace shardckpt {

inline constexpr int max_rank = 8;

// A shape of rank 1..max_rank held inline, so views carry it without allocating. Dim 0 is rows;
// the trailing dims are contiguous within a row.
class Extents {
 public:
  constexpr Extents() = default;
  constexpr Extents(std::initializer_list<std::int64_t> dims) { assign(dims); }
  explicit constexpr Extents(std::span<const std::int64_t> dims) { assign(dims); }

  constexpr int rank() const noexcept { return rank_; }
  constexpr std::int64_t operator[](int d) const noexcept { return dims_[d]; }
  constexpr std::int64_t rows() const noexcept { return rank_ ? dims_[0] : 0; }
  constexpr std::int64_t row_elems() const noexcept {
    std::int64_t n = 1;
    for (int d = 1; d < rank_; ++d) n *= dims_[d];
    return n;
  }
  constexpr std::int64_t elements() const noexcept { return rows() * row_elems(); }
  constexpr Extents with_rows(std::int64_t rows) const noexcept {
    Extents e = *this;
    e.dims_[0] = rows;
    return e;
  }
  constexpr std::span<const std::int64_t> dims() const noexcept [[clang::lifetimebound]] {
    return {dims_.data(), static_cast<std::size_t>(rank_)};
  }
  std::vector<std::int64_t> to_vector() const { return {dims().begin(), dims().end()}; }
  friend constexpr bool operator==(const Extents&, const Extents&) = default;

 private:
  template <class Range>
  constexpr void assign(const Range& dims) {
    // Plain throws, not require(): a constant expression may not call a non-constexpr function.
    if (dims.size() < 1 || dims.size() > max_rank)
      throw Error(Errc::invalid_argument, cat("tensor rank ", dims.size(), " is outside [1, ", max_rank, "]"));
    for (std::int64_t d : dims) {
      if (d < 0) throw Error(Errc::invalid_argument, cat("tensor dims must be >= 0 (got ", d, ")"));
      dims_[rank_++] = d;
    }
  }
  std::array<std::int64_t, max_rank> dims_{};
  int rank_ = 0;
};

// A row-major tensor someone else owns. `Mutable` selects TensorView (read-only) or MutTensorView.
template <bool Mutable>
class BasicView {
 public:
  using byte_type = std::conditional_t<Mutable, std::byte, const std::byte>;
  using pointer = std::conditional_t<Mutable, void*, const void*>;

  constexpr BasicView() noexcept = default;
  // Borrows memory the caller owns and keeps alive (a framework's tensor, a pinned buffer).
  static BasicView borrow(pointer data, DType dtype, Extents shape) noexcept {
    return BasicView(static_cast<byte_type*>(data), dtype, shape);
  }
  operator BasicView<false>() const noexcept
    requires Mutable
  {
    return BasicView<false>::borrow(data_, dtype_, shape_);
  }

  constexpr byte_type* data() const noexcept { return data_; }
  constexpr DType dtype() const noexcept { return dtype_; }
  constexpr const Extents& shape() const noexcept [[clang::lifetimebound]] { return shape_; }
  constexpr std::int64_t rows() const noexcept { return shape_.rows(); }
  constexpr std::size_t row_bytes() const noexcept {
    return static_cast<std::size_t>(shape_.row_elems()) * dtype_size(dtype_);
  }
  constexpr std::size_t bytes() const noexcept { return static_cast<std::size_t>(rows()) * row_bytes(); }
  constexpr bool empty() const noexcept { return bytes() == 0; }

  // Rows [lo, hi) of the same memory. Throws Errc::invalid_argument when out of range.
  constexpr BasicView rows(std::int64_t lo, std::int64_t hi) const {
    if (lo < 0 || lo > hi || hi > rows())
      throw Error(Errc::invalid_argument, cat("rows [", lo, ", ", hi, ") are outside a view of ", rows(), " rows"));
    return BasicView(data_ + static_cast<std::size_t>(lo) * row_bytes(), dtype_, shape_.with_rows(hi - lo));
  }

  // The elements as T. Throws Errc::dtype_mismatch unless T is the view's dtype.
  template <Element T>
  std::span<std::conditional_t<Mutable, T, const T>> as() const {
    require(dtype_v<T> == dtype_, Errc::dtype_mismatch, "a ", dtype_name(dtype_), " view read as ",
            dtype_name(dtype_v<T>));
    using E = std::conditional_t<Mutable, T, const T>;
    return {reinterpret_cast<E*>(data_), static_cast<std::size_t>(shape_.elements())};
  }

 private:
  constexpr BasicView(byte_type* data, DType dtype, Extents shape) noexcept
      : data_(data), dtype_(dtype), shape_(shape) {}
  byte_type* data_ = nullptr;
  DType dtype_ = DType::f32;
  Extents shape_;
};

using TensorView = BasicView<false>;
using MutTensorView = BasicView<true>;

// Owns an aligned host allocation of one dtype and shape. Move-only: the only copy is deep_copy().
class HostBuffer {
 public:
  // Alignment of every allocation: a page, so that buffers suit direct and positional I/O.
  static constexpr std::size_t alignment = 4096;

  HostBuffer() = default;
  static HostBuffer zeros(DType dtype, Extents shape);
  // Contents unspecified: for buffers about to be overwritten whole (by a read, say).
  static HostBuffer uninitialized(DType dtype, Extents shape);

  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& other) noexcept { swap(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    HostBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~HostBuffer();

  // An independent copy; counts as a materialization (see materialize()).
  HostBuffer deep_copy() const;

  TensorView view() const& [[clang::lifetimebound]] { return TensorView::borrow(data_, dtype_, shape_); }
  MutTensorView mut_view() & [[clang::lifetimebound]] { return MutTensorView::borrow(data_, dtype_, shape_); }
  // A view of a temporary would dangle as soon as the statement ends.
  TensorView view() const&& = delete;
  MutTensorView mut_view() && = delete;

  DType dtype() const noexcept { return dtype_; }
  const Extents& shape() const noexcept [[clang::lifetimebound]] { return shape_; }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(shape_.elements()) * dtype_size(dtype_); }

 private:
  HostBuffer(DType dtype, Extents shape, bool zero);
  void swap(HostBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(dtype_, other.dtype_);
    std::swap(shape_, other.shape_);
  }
  std::byte* data_ = nullptr;
  DType dtype_ = DType::f32;
  Extents shape_{0};
};

// Copies a view into a new owner: the only way a full tensor comes into being. Counted; throws
// Errc::materialization_forbidden while a ForbidMaterialization is alive on this thread.
HostBuffer materialize(TensorView view);
// The same for several views stacked row-wise (an all-gather's result): one counted materialization.
// \requires the views share dtype and row shape.
HostBuffer materialize(std::span<const TensorView> parts);
// Materializations so far in this process (all threads).
std::uint64_t materialization_count() noexcept;

// While alive, materialize() on this thread throws instead of copying. Nestable. A save holds one
// so that a code path that would gather or stage a tensor fails loudly instead of using memory.
class ForbidMaterialization {
 public:
  ForbidMaterialization() noexcept;
  ~ForbidMaterialization();
  ForbidMaterialization(const ForbidMaterialization&) = delete;
  ForbidMaterialization& operator=(const ForbidMaterialization&) = delete;
};
bool materialization_forbidden() noexcept;

}  // namespace shardckpt
