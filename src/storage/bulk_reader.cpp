module;
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :os;

namespace shardckpt::io {

// ---- bulk reads that bypass the page cache ----------------------------------------------------

namespace {

// O_DIRECT transfers start, end and land at multiples of this: the logical block of every common
// block device is 512 or 4096 bytes. A file system that wants more refuses with EINVAL.
constexpr std::uint64_t direct_align = 4096;
constexpr std::size_t bounce_bytes = std::size_t{1} << 20;
// Offsets past this go to the plain descriptor (whose read reports them), so aligning never overflows.
constexpr auto limit = static_cast<std::uint64_t>(std::numeric_limits<off_t>::max()) - direct_align;

std::uint64_t align_down(std::uint64_t x) { return x & ~(direct_align - 1); }
std::uint64_t align_up(std::uint64_t x) { return align_down(x + direct_align - 1); }
bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % direct_align == 0; }

struct FreeBounce {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using Bounce = std::unique_ptr<std::byte, FreeBounce>;

}  // namespace

struct BulkReader::State {
  explicit State(const File& f) : file(f) {}
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    if (fd >= 0) ::close(fd);
  }

  const File& file;
  int fd = -1;  // the O_DIRECT descriptor
  std::atomic<bool> direct{false};
  std::mutex mutex;
  std::vector<Bounce> spare;  // bounce buffers between reads

  Bounce take() {
    {
      const std::lock_guard lock(mutex);
      if (!spare.empty()) {
        Bounce b = std::move(spare.back());
        spare.pop_back();
        return b;
      }
    }
    auto* p = static_cast<std::byte*>(std::aligned_alloc(direct_align, bounce_bytes));
    if (p == nullptr) throw std::bad_alloc();
    return Bounce(p);
  }

  void give(Bounce b) {
    const std::lock_guard lock(mutex);
    spare.push_back(std::move(b));
  }

  // Reads up to `n` bytes at `offset` (`dst`, `n` and `offset` aligned) through the O_DIRECT
  // descriptor: how many it read (fewer only at the end of the file), or nothing when the kernel
  // refuses direct reads of this file (EINVAL), which ends them for this reader.
  std::optional<std::size_t> direct_read(std::byte* dst, std::size_t n, std::uint64_t offset) {
    std::size_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd, dst + done, std::min(n - done, max_transfer), static_cast<off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno == EINVAL) {
        direct = false;
        return std::nullopt;
      }
      if (got < 0) fail_at("read", file.path(), n, offset, errno);
      if (got == 0) break;
      done += static_cast<std::size_t>(got);
      if (done % direct_align != 0) break;  // the end of the file
    }
    bytes_read.fetch_add(done, std::memory_order_relaxed);
    return done;
  }

  // `n` bytes at `offset` through a bounce buffer: how many the file holds, up to `n`.
  std::size_t bounced(std::byte* dst, std::size_t n, std::uint64_t offset) {
    Bounce b = take();
    std::size_t done = 0;
    while (done < n) {
      const std::uint64_t at = offset + done, start = align_down(at);
      const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(bounce_bytes, align_up(offset + n) - start));
      const std::optional<std::size_t> got = direct_read(b.get(), want, start);
      if (!got) {
        done += file.pread_upto(dst + done, n - done, at);
        break;
      }
      const auto skip = static_cast<std::size_t>(at - start);
      if (*got <= skip) break;
      const std::size_t use = std::min(*got - skip, n - done);
      std::memcpy(dst + done, b.get() + skip, use);
      done += use;
      if (*got < want) break;
    }
    give(std::move(b));
    return done;
  }

  // Up to `n` bytes at `offset`: the aligned middle straight into `dst` where it lies aligned, the
  // rest through a bounce buffer.
  std::size_t read_upto(std::byte* dst, std::size_t n, std::uint64_t offset) {
    if (!direct || n == 0 || offset > limit || n > limit - offset) return file.pread_upto(dst, n, offset);
    const std::uint64_t a = align_up(offset), b = align_down(offset + n);
    std::byte* middle = dst + (a - offset);
    if (a >= b || !aligned(middle)) return bounced(dst, n, offset);
    const std::size_t head = a - offset;
    std::size_t done = head ? bounced(dst, head, offset) : 0;
    if (done < head) return done;
    const std::optional<std::size_t> got = direct_read(middle, b - a, a);
    if (!got) return done + file.pread_upto(middle, n - head, a);
    done += *got;
    if (*got < b - a || offset + n == b) return done;
    return done + bounced(dst + (b - offset), offset + n - b, b);
  }
};

BulkReader::BulkReader(const File& file, PageCache cache) : state_(std::make_unique<State>(file)) {
  if (cache == PageCache::use) return;
  const FileIdentity mine = file.identity();
  const auto same = [&](const struct stat& st) {
    return static_cast<std::uint64_t>(st.st_dev) == mine.device && static_cast<std::uint64_t>(st.st_ino) == mine.inode;
  };
  // Only while the path still names the checked file (stat opens nothing): then that file itself is
  // opened again, through its descriptor's link in /proc/self/fd, which no rename redirects, never
  // the path, where a FIFO may stand by now. Without /proc, the path, without following a link or
  // blocking, and checked to be the same file.
  struct stat st {};
  if (::stat(file.path().c_str(), &st) != 0 || !same(st)) return;  // read through the descriptor that was checked
  const std::string own = cat("/proc/self/fd/", file.descriptor());
  int fd = ::open(own.c_str(), O_RDONLY | O_DIRECT | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0 && errno == ENOENT) fd = ::open(file.path().c_str(), O_RDONLY | O_DIRECT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return;
  if (::fstat(fd, &st) != 0 || !same(st)) {
    ::close(fd);
    return;
  }
  state_->fd = fd;
  state_->direct = true;
}

BulkReader::~BulkReader() = default;

bool BulkReader::bypasses() const noexcept { return state_->direct; }

void BulkReader::read(void* dst, std::size_t n, std::uint64_t offset) const {
  auto* p = static_cast<std::byte*>(dst);
  const std::size_t got = state_->read_upto(p, n, offset);
  // The rest, if any, the way a plain read reports it: a truncated file, or a read error.
  if (got < n) state_->file.pread_all(p + got, n - got, offset + got);
}

void BulkReader::read_runs(std::byte* dst, std::size_t run, std::size_t stride, std::size_t count,
                           std::uint64_t offset) const {
  State& s = *state_;
  std::size_t total = 0;
  const bool out_of_range = __builtin_mul_overflow(run, count, &total) || offset > limit || total > limit - offset;
  // Rows that fill bounce buffers on their own are read one by one, straight into place.
  if (!s.direct || out_of_range || run >= bounce_bytes / 2) {
    for (std::size_t r = 0; r < count; ++r) read(dst + r * stride, run, offset + r * run);
    return;
  }
  // The rows follow each other in the file: read a bounce buffer's worth, scatter it to the rows.
  const auto scatter = [&](std::uint64_t from, std::uint64_t to, const auto& move) {
    while (from < to) {
      const std::uint64_t r = (from - offset) / run, in_row = from - offset - r * run;
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(run - in_row, to - from));
      move(dst + r * stride + in_row, n, from);
      from += n;
    }
  };
  const std::uint64_t end = offset + total;
  std::uint64_t at = offset;
  Bounce b = s.take();
  while (at < end) {
    const std::uint64_t start = align_down(at);
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(bounce_bytes, align_up(end) - start));
    const std::optional<std::size_t> got = s.direct_read(b.get(), want, start);
    const std::uint64_t have = got ? std::min(end, start + *got) : at;
    scatter(at, have,
            [&](std::byte* p, std::size_t n, std::uint64_t from) { std::memcpy(p, b.get() + (from - start), n); });
    at = have;
    if (!got || *got < want) break;
  }
  s.give(std::move(b));
  // What the direct reads did not bring (the end of the file, or a refusal), read plainly.
  scatter(at, end, [&](std::byte* p, std::size_t n, std::uint64_t from) { s.file.pread_all(p, n, from); });
}

}  // namespace shardckpt::io
