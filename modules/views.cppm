// shardckpt.views: who owns tensor memory, where it lives, and how others look at it without owning it.
// A view knows its memory space: host (pageable), pinned host, or a device; device bytes are never
// read or written on the host (they move only through a CopyEngine, shardckpt.engine).
// HostBuffer owns (move-only, aligned, copied only by an explicit deep_copy); SharedBuffer shares
// ownership of memory the library allocated; TensorView and MutTensorView look (tiny values, never
// allocate, never own, never become owners implicitly). What a state dict holds is a TensorRef:
// shared ownership, or a borrow whose name says nothing checks it.
// Turning a view into a new owner is `materialize`, the one counted copy, which a save forbids with
// ForbidMaterialization. This module does no I/O.
module;
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>
export module shardckpt.views;
import shardckpt.core;

export namespace shardckpt {

inline constexpr int max_rank = 8;

// A shape of rank 1..max_rank held inline, so views carry it without allocating. Dim 0 is rows;
// the trailing dims are contiguous within a row. Its element count always fits int64.
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
  constexpr Extents with_rows(std::int64_t rows) const {
    Extents e = *this;
    e.dims_[0] = rows;
    e.check();
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
    for (std::int64_t d : dims) dims_[rank_++] = d;
    check();
  }
  constexpr void check() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) {
      if (dims_[i] < 0) throw Error(Errc::invalid_argument, cat("tensor dims must be >= 0 (got ", dims_[i], ")"));
      if (__builtin_mul_overflow(n, dims_[i], &n))
        throw Error(Errc::invalid_argument, "a tensor shape whose element count overflows 64 bits");
    }
  }
  std::array<std::int64_t, max_rank> dims_{};
  int rank_ = 0;
};

// Where a tensor's bytes are: the host's pageable memory, host memory pinned for fast copies to
// and from a device, or the memory of device `device` (a CUDA device, or an emulated one).
enum class MemoryKind : std::uint8_t { host, pinned, device };

struct MemorySpace {
  MemoryKind kind = MemoryKind::host;
  int device = -1;

  static constexpr MemorySpace host() noexcept { return {}; }
  static constexpr MemorySpace pinned() noexcept { return {MemoryKind::pinned, -1}; }
  static constexpr MemorySpace on_device(int id) noexcept { return {MemoryKind::device, id}; }
  constexpr bool host_accessible() const noexcept { return kind != MemoryKind::device; }
  friend constexpr bool operator==(MemorySpace, MemorySpace) = default;
};
std::string memory_space_text(MemorySpace space);

// A row-major tensor someone else owns. `Mutable` selects TensorView (read-only) or MutTensorView.
template <bool Mutable>
class BasicView {
 public:
  using byte_type = std::conditional_t<Mutable, std::byte, const std::byte>;
  using pointer = std::conditional_t<Mutable, void*, const void*>;

  constexpr BasicView() noexcept = default;
  // Looks at memory the caller owns and keeps alive (a framework's tensor, a pinned buffer): nothing
  // can check that `data` holds `shape` elements of `dtype` in `space`, or that it outlives the view,
  // which is what the name says. Throws Errc::invalid_argument for a null pointer to a non-empty
  // tensor, or one not aligned to its element in host memory. A view keeps nothing alive: see
  // TensorRef for what a state dict holds.
  static BasicView unchecked(pointer data, DType dtype, Extents shape, MemorySpace space = MemorySpace::host()) {
    const auto bytes = static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
    if (bytes != 0 && data == nullptr)
      throw Error(Errc::invalid_argument, cat("a view of ", bytes, " bytes at a null pointer"));
    if (space.host_accessible() && reinterpret_cast<std::uintptr_t>(data) % dtype_size(dtype) != 0)
      throw Error(Errc::invalid_argument, cat("a ", dtype_name(dtype), " view at an address not aligned to its ",
                                              dtype_size(dtype), "-byte elements"));
    return BasicView(static_cast<byte_type*>(data), dtype, shape, space);
  }
  operator BasicView<false>() const noexcept
    requires Mutable
  {
    return BasicView<false>(data_, dtype_, shape_, space_);
  }

  // The address of the first element, in the view's memory space: for a device, not an address
  // the host may dereference.
  constexpr byte_type* data() const noexcept { return data_; }
  constexpr DType dtype() const noexcept { return dtype_; }
  constexpr MemorySpace space() const noexcept { return space_; }
  constexpr const Extents& shape() const noexcept [[clang::lifetimebound]] { return shape_; }
  constexpr std::int64_t rows() const noexcept { return shape_.rows(); }
  constexpr std::size_t row_bytes() const noexcept {
    return static_cast<std::size_t>(shape_.row_elems()) * dtype_size(dtype_);
  }
  constexpr std::size_t bytes() const noexcept { return static_cast<std::size_t>(rows()) * row_bytes(); }
  constexpr bool empty() const noexcept { return bytes() == 0; }

  // Rows [lo, hi) of the same memory. Throws Errc::invalid_argument when out of range.
  constexpr BasicView slice_rows(std::int64_t lo, std::int64_t hi) const {
    if (lo < 0 || lo > hi || hi > rows())
      throw Error(Errc::invalid_argument, cat("rows [", lo, ", ", hi, ") are outside a view of ", rows(), " rows"));
    return BasicView(data_ + static_cast<std::size_t>(lo) * row_bytes(), dtype_, shape_.with_rows(hi - lo), space_);
  }

  // The same bytes seen as `to`: the one named way to reinterpret a dtype (bf16 sent as u16 bytes,
  // say). The last dim scales so that every row keeps its bytes. Throws Errc::dtype_mismatch when
  // the last dim's bytes are not a whole number of `to` elements, Errc::invalid_argument when host
  // memory is not aligned to them.
  BasicView reinterpreted_as(DType to) const {
    const int last = shape_.rank() - 1;
    const auto from_size = static_cast<std::int64_t>(dtype_size(dtype_)), to_size = static_cast<std::int64_t>(dtype_size(to));
    require(last >= 0 && shape_[last] * from_size % to_size == 0, Errc::dtype_mismatch, "a ", dtype_name(dtype_),
            " view's last dim (", last >= 0 ? shape_[last] : 0, " elements) is not a whole number of ",
            dtype_name(to), " elements");
    std::array<std::int64_t, max_rank> dims{};
    for (int d = 0; d <= last; ++d) dims[d] = shape_[d];
    dims[last] = shape_[last] * from_size / to_size;
    return unchecked(data_, to, Extents(std::span<const std::int64_t>(dims.data(), static_cast<std::size_t>(last + 1))), space_);
  }

  // The elements as T, for host memory. Throws Errc::dtype_mismatch unless T is the view's dtype,
  // Errc::invalid_argument for device memory (which moves only through a CopyEngine).
  template <Element T>
  std::span<std::conditional_t<Mutable, T, const T>> as() const {
    require(dtype_v<T> == dtype_, Errc::dtype_mismatch, "a ", dtype_name(dtype_), " view read as ",
            dtype_name(dtype_v<T>));
    require(space_.host_accessible(), Errc::invalid_argument, "the elements of a view of ",
            memory_space_text(space_), " memory cannot be read on the host: copy them with a CopyEngine");
    using E = std::conditional_t<Mutable, T, const T>;
    return {reinterpret_cast<E*>(data_), static_cast<std::size_t>(shape_.elements())};
  }

 private:
  template <bool>
  friend class BasicView;
  friend class HostBuffer;
  constexpr BasicView(byte_type* data, DType dtype, Extents shape, MemorySpace space) noexcept
      : data_(data), dtype_(dtype), shape_(shape), space_(space) {}
  byte_type* data_ = nullptr;
  DType dtype_ = DType::f32;
  Extents shape_;
  MemorySpace space_;
};

using TensorView = BasicView<false>;
using MutTensorView = BasicView<true>;

// Tensor memory this process allocated through the library, for tests that count it: HostBuffer,
// SharedBuffer and pinned or device buffers of a CopyEngine.
struct BufferStats {
  std::uint64_t allocations = 0;
  std::uint64_t bytes = 0;
};
BufferStats buffer_stats() noexcept;
// For engines: counts an allocation of their own.
void count_allocation(std::size_t bytes) noexcept;

// The host memory of this machine (physical memory, or less where a resource limit of this process
// says so), and a check that `bytes` fit in it: Errc::resources naming `what` and both sizes.
std::uint64_t host_memory_bytes() noexcept;
void require_host_memory(std::uint64_t bytes, std::string_view what);

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

  TensorView view() const& [[clang::lifetimebound]] { return TensorView(data_, dtype_, shape_, MemorySpace::host()); }
  MutTensorView mut_view() & [[clang::lifetimebound]] {
    return MutTensorView(data_, dtype_, shape_, MemorySpace::host());
  }
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

// Memory an allocator owns: its bytes, where they are, and (in the destructor of each kind) how they
// are freed. Host buffers, an engine's pinned and device memory are allocations; a SharedBuffer views
// only memory inside the allocation it shares, so an owner is never paired with memory it does not own.
class Allocation {
 public:
  virtual ~Allocation() = default;
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  std::byte* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  MemorySpace space() const noexcept { return space_; }

 protected:
  // For allocators: `bytes` at `data` in `space`, which the derived class frees.
  Allocation(void* data, std::size_t bytes, MemorySpace space) noexcept
      : data_(static_cast<std::byte*>(data)), bytes_(bytes), space_(space) {}

 private:
  std::byte* data_;
  std::size_t bytes_;
  MemorySpace space_;
};

// Shared ownership of tensor memory the library allocated (host, pinned or device): copies share
// it, and it lives while any copy, or any TensorRef made from one, does. A mutable view comes only
// from a non-const owner.
class SharedBuffer {
 public:
  SharedBuffer() = default;
  // Host memory, counted like a HostBuffer.
  static SharedBuffer zeros(DType dtype, Extents shape);
  static SharedBuffer uninitialized(DType dtype, Extents shape);
  // Takes over a HostBuffer.
  explicit SharedBuffer(HostBuffer&& owner);
  // A tensor of `dtype` and `shape` at the start of `memory` (an engine's pinned or device
  // allocation). Throws Errc::invalid_argument when it does not fit the allocation.
  SharedBuffer(std::shared_ptr<Allocation> memory, DType dtype, Extents shape);

  TensorView view() const& [[clang::lifetimebound]] { return view_; }
  MutTensorView mut_view() & [[clang::lifetimebound]] { return view_; }
  // A const owner lends no mutable memory.
  MutTensorView mut_view() const& = delete;
  // A view of a temporary: the last owner could go with the statement.
  TensorView view() const&& = delete;
  MutTensorView mut_view() && = delete;

  DType dtype() const noexcept { return view_.dtype(); }
  MemorySpace space() const noexcept { return view_.space(); }
  const Extents& shape() const noexcept [[clang::lifetimebound]] { return view_.shape(); }
  std::size_t bytes() const noexcept { return view_.bytes(); }
  explicit operator bool() const noexcept { return memory_ != nullptr; }

 private:
  friend class TensorRef;
  std::shared_ptr<Allocation> memory_;
  MutTensorView view_;
};

// The tensor memory a state dict refers to. Either shared ownership (from a SharedBuffer: the state
// dict keeps the memory alive), or a borrow of memory someone else keeps alive, such as a
// framework's tensor: unchecked_borrow says so in its name, because nothing can check it. A plain
// view does not convert to a TensorRef. A TensorRef is writable (a load may fill it) only when made
// from a non-const owner or a mutable borrow; a load refuses a read-only one before it reads a byte.
class TensorRef {
 public:
  TensorRef() = default;
  TensorRef(SharedBuffer& buffer) noexcept
      : keep_(buffer.memory_), view_(buffer.view_), mutable_(buffer.view_), writable_(true) {}
  TensorRef(SharedBuffer&& buffer) noexcept
      : keep_(std::move(buffer.memory_)), view_(buffer.view_), mutable_(buffer.view_), writable_(true) {}
  // A const owner lends no mutable memory: TensorRef::read_only says that the entry is for saving.
  TensorRef(const SharedBuffer& buffer) = delete;
  static TensorRef read_only(const SharedBuffer& buffer) noexcept {
    TensorRef r;
    r.keep_ = buffer.memory_;
    r.view_ = buffer.view_;
    return r;
  }
  friend TensorRef unchecked_borrow(MutTensorView view) noexcept;
  friend TensorRef unchecked_borrow(TensorView view) noexcept;

  TensorView view() const& [[clang::lifetimebound]] { return view_; }
  // For loads into the memory; throws Errc::invalid_argument for a read-only entry.
  MutTensorView mut_view() & [[clang::lifetimebound]];
  // A const state dict lends no mutable memory.
  MutTensorView mut_view() const& = delete;
  TensorView view() const&& = delete;
  MutTensorView mut_view() && = delete;

  // False for a default-constructed TensorRef (a load request's entries carry none).
  explicit operator bool() const noexcept { return view_.shape().rank() > 0; }
  DType dtype() const noexcept { return view_.dtype(); }
  MemorySpace space() const noexcept { return view_.space(); }
  const Extents& shape() const noexcept [[clang::lifetimebound]] { return view_.shape(); }
  // True when the state dict keeps the memory alive (not a borrow).
  bool owning() const noexcept { return keep_ != nullptr; }
  // True when a load may fill the memory.
  bool writable() const noexcept { return writable_; }

 private:
  std::shared_ptr<Allocation> keep_;
  TensorView view_;
  MutTensorView mutable_;  // the same memory, when writable; empty for a read-only entry
  bool writable_ = false;
};

TensorRef unchecked_borrow(MutTensorView view) noexcept;
TensorRef unchecked_borrow(TensorView view) noexcept;

// Copies a host view into a new owner: the only way a full tensor comes into being. Counted;
// throws Errc::materialization_forbidden while a ForbidMaterialization is alive on this thread.
HostBuffer materialize(TensorView view);
// The same for several views stacked row-wise (an all-gather's result): one counted materialization.
// \requires the views share dtype and row shape.
HostBuffer materialize(std::span<const TensorView> parts);
// Counts a whole tensor of `bytes` that something else builds (a load asked for a tensor at its
// global shape), or throws Errc::materialization_forbidden naming `what`.
void count_materialization(std::string_view what, std::size_t bytes);
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
