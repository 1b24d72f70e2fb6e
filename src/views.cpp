module;
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
module shardckpt.views;

namespace shardckpt {
namespace {

std::atomic<std::uint64_t> materializations{0};
std::atomic<std::uint64_t> allocations{0};
std::atomic<std::uint64_t> allocated_bytes{0};
thread_local int forbid_depth = 0;

// A buffer of a huge page or more is aligned to huge pages and asks the kernel to back it with them
// (madvise MADV_HUGEPAGE: transparent huge pages are commonly on for regions that ask). A load fills
// buffers it just allocated, and faulting them in 4 KiB at a time dominated it on one thread: a
// cached 240 MB file read into fresh memory at 1.5 GB/s in 4 KiB pages, 6.5 GB/s in huge pages
// (docs/performance.md, "Beside PyTorch DCP and safetensors").
constexpr std::size_t huge_page = std::size_t{2} << 20;

std::size_t alignment_of(std::size_t bytes) noexcept {
  return bytes >= huge_page ? huge_page : HostBuffer::alignment;
}

}  // namespace

std::string memory_space_text(MemorySpace space) {
  switch (space.kind) {
    case MemoryKind::host:
      return "host";
    case MemoryKind::pinned:
      return "pinned host";
    case MemoryKind::device:
      return cat("device ", space.device);
  }
  return "?";
}

std::uint64_t host_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  std::uint64_t out = pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page)
                                            : ~std::uint64_t{0};
  for (const int limit : {RLIMIT_AS, RLIMIT_DATA}) {
    struct rlimit rl{};
    if (::getrlimit(limit, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
      out = std::min<std::uint64_t>(out, static_cast<std::uint64_t>(rl.rlim_cur));
  }
  return out;
}

void require_host_memory(std::uint64_t bytes, std::string_view what) {
  const std::uint64_t have = host_memory_bytes();
  require(bytes <= have, Errc::resources, what, " needs ", bytes, " bytes of host memory, more than the ", have,
          " this process can have");
}

BufferStats buffer_stats() noexcept { return {allocations.load(), allocated_bytes.load()}; }

void count_allocation(std::size_t bytes) noexcept {
  allocations.fetch_add(1, std::memory_order_relaxed);
  allocated_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

HostBuffer::HostBuffer(DType dtype, Extents shape, bool zero) : dtype_(dtype), shape_(shape) {
  const std::size_t n = bytes();
  if (n == 0) return;
  const std::size_t align = alignment_of(n);
  data_ = static_cast<std::byte*>(::operator new(n, std::align_val_t{align}));
  if (align == huge_page) (void)::madvise(data_, n / huge_page * huge_page, MADV_HUGEPAGE);  // a hint only
  count_allocation(n);
  if (zero) std::memset(data_, 0, n);
}

HostBuffer HostBuffer::zeros(DType dtype, Extents shape) { return HostBuffer(dtype, shape, true); }
HostBuffer HostBuffer::uninitialized(DType dtype, Extents shape) { return HostBuffer(dtype, shape, false); }

HostBuffer::~HostBuffer() {
  if (data_) ::operator delete(data_, std::align_val_t{alignment_of(bytes())});
}

HostBuffer HostBuffer::deep_copy() const { return materialize(view()); }

namespace {

// A HostBuffer as an allocation that SharedBuffers share.
class HostAllocation final : public Allocation {
 public:
  explicit HostAllocation(HostBuffer&& owner)
      : Allocation(owner.mut_view().data(), owner.bytes(), MemorySpace::host()), owner_(std::move(owner)) {}
  MutTensorView view() { return owner_.mut_view(); }

 private:
  HostBuffer owner_;
};

}  // namespace

SharedBuffer::SharedBuffer(HostBuffer&& owner) {
  auto held = std::make_shared<HostAllocation>(std::move(owner));
  view_ = held->view();
  memory_ = std::move(held);
}

SharedBuffer::SharedBuffer(std::shared_ptr<Allocation> memory, DType dtype, Extents shape) {
  require(memory != nullptr, Errc::invalid_argument, "a shared buffer of no allocation");
  const std::size_t bytes = static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
  require(bytes <= memory->bytes(), Errc::invalid_argument, "a ", dtype_name(dtype), " tensor of shape ",
          dims_text(shape.dims()), " (", bytes, " bytes) does not fit an allocation of ", memory->bytes(), " bytes");
  view_ = MutTensorView::unchecked(memory->data(), dtype, shape, memory->space());
  memory_ = std::move(memory);
}

SharedBuffer SharedBuffer::zeros(DType dtype, Extents shape) { return SharedBuffer(HostBuffer::zeros(dtype, shape)); }

SharedBuffer SharedBuffer::uninitialized(DType dtype, Extents shape) {
  return SharedBuffer(HostBuffer::uninitialized(dtype, shape));
}


MutTensorView TensorRef::mut_view() & {
  require(writable_, Errc::invalid_argument,
          "a read-only entry (TensorRef::read_only, or a borrowed TensorView) cannot be loaded into: give the "
          "state dict a non-const SharedBuffer or borrow a MutTensorView");
  return mutable_;
}

TensorRef unchecked_borrow(MutTensorView view) noexcept {
  TensorRef r;
  r.view_ = view;
  r.mutable_ = view;
  r.writable_ = true;
  return r;
}

TensorRef unchecked_borrow(TensorView view) noexcept {
  TensorRef r;
  r.view_ = view;
  return r;
}

HostBuffer materialize(TensorView view) { return materialize(std::span<const TensorView>(&view, 1)); }

void count_materialization(std::string_view what, std::size_t bytes) {
  require(forbid_depth == 0, Errc::materialization_forbidden, what, " (", bytes,
          " bytes) while materialization is forbidden");
  materializations.fetch_add(1, std::memory_order_relaxed);
}

HostBuffer materialize(std::span<const TensorView> parts) {
  require(!parts.empty(), Errc::invalid_argument, "materializing nothing");
  std::int64_t rows = 0;
  std::size_t bytes = 0;
  for (const TensorView& p : parts) {
    require(p.dtype() == parts[0].dtype() && p.shape().with_rows(0) == parts[0].shape().with_rows(0),
            Errc::shape_mismatch, "materializing views of different dtype or row shape");
    require(p.space().host_accessible(), Errc::invalid_argument, "materializing a view of ",
            memory_space_text(p.space()), " memory");
    rows += p.rows();
    bytes += p.bytes();
  }
  count_materialization(cat("materializing a ", dtype_name(parts[0].dtype()), " tensor of ", rows, " rows"), bytes);
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
