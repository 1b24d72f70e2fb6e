// Tensors over the checkpoint file (CheckpointReader::map): where a dataset's rows lie in the file
// exactly as a tensor's rows lie in memory, the tensor is a private mapping of them, every row
// checked against its checksum over the mapped pages, instead of new memory the kernel must zero
// and a copy into it. One mapping of the whole file per reader, shared by every tensor over it.
module;
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :raw;
import :reader_state;
import shardckpt.guarded;

namespace shardckpt {

namespace {

std::size_t page_bytes() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }
std::size_t round_to_page(std::size_t n) { return (n + page_bytes() - 1) / page_bytes() * page_bytes(); }

}  // namespace

// A private, writable mapping of a whole checkpoint file (a write to a tensor over it copies the
// page: it never reaches the file), unmapped when the last tensor over it goes. The mapping holds
// the file's pages, not its descriptor: the reader may close first. It is registered
// (io::MappedRange) for as long as it exists, so that a read of its bytes under io::run_guarded
// meets a page lost to a file cut short as an error, not as SIGBUS; one that could not be
// registered is not used (guarded() false: its tensors are read into memory instead).
struct FileMapping {
  std::byte* base = nullptr;
  std::size_t size = 0;
  std::optional<io::MappedRange> guard;
  // The byte ranges of the file that tensors alive now lie over (begin -> end). Two tensors over the
  // same bytes of one private mapping would be one memory (a dataset hard-linked under two names,
  // rows of one reader asked for twice): a range that overlaps a lent one is not lent (its tensor is
  // read into memory of its own), and a tensor gives its range back when it goes.
  mutable Guarded<std::map<std::uint64_t, std::uint64_t>> lent;

  // Lends bytes [begin, end) (offsets in the file) to one tensor: false where another tensor alive
  // lies over any of them. An empty range shares nothing.
  bool lend(std::uint64_t begin, std::uint64_t end) const {
    if (begin >= end) return true;
    const auto held = lent.lock();
    const auto next = held->upper_bound(begin);  // the first range that starts after `begin`
    if (next != held->end() && next->first < end) return false;
    if (next != held->begin() && std::prev(next)->second > begin) return false;
    held->emplace_hint(next, begin, end);
    return true;
  }
  void give_back(std::uint64_t begin) const { lent.lock()->erase(begin); }

  FileMapping(const io::File& f, std::uint64_t size_at_open, const std::filesystem::path& path) {
    // The file the reader checked: the same inode (one descriptor), and still its size. A file that
    // grew or shrank since the open was changed by someone else: its metadata no longer describes it.
    const std::uint64_t now = f.size();
    require(now == size_at_open, Errc::replaced, path.string(), ": the file changed since it was opened (", size_at_open,
            " bytes then, ", now, " now): nothing is mapped");
    require(now > 0 && now <= static_cast<std::uint64_t>(SIZE_MAX), Errc::not_a_checkpoint, path.string(),
            ": a file of ", now, " bytes cannot be mapped");
    size = static_cast<std::size_t>(now);
    base = static_cast<std::byte*>(map_aligned(f, size, path));
    guard.emplace(base, round_to_page(size), path);
  }
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping() {
    guard.reset();  // before the addresses can be someone else's
    ::munmap(base, size);
  }
  bool guarded() const { return guard && guard->registered(); }

 private:
  // The file mapped at an address that is a multiple of 2 MiB, so that each address lies at its file
  // offset modulo 2 MiB: the kernel can then map the page cache's 2 MiB folios whole (one entry
  // instead of 512). That brings a file in faster, and on this project's virtual machines it spares
  // the host's cost for the first touch of each 4 KiB page that came into the guest's page cache
  // (measured, a 1 GiB file read one byte per page after MADV_POPULATE_READ: 0.004 s in each of 20
  // rounds mapped so, 0.2-0.3 s in 6 of 20 rounds mapped 4 KiB off). Recent kernels choose such an
  // address themselves; this asks for it.
  static void* map_aligned(const io::File& f, std::size_t size, const std::filesystem::path& path) {
    constexpr std::size_t huge = std::size_t{2} << 20;
    const std::size_t span = round_to_page(size);  // what the mapping takes of the address space
    void* reserved = span >= huge && span <= SIZE_MAX - huge
                         ? ::mmap(nullptr, span + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                         : MAP_FAILED;
    void* at = nullptr;
    int flags = MAP_PRIVATE;
    if (reserved != MAP_FAILED) {  // else anywhere: only the speed differs
      const auto r = reinterpret_cast<std::uintptr_t>(reserved);
      const std::uintptr_t aligned = (r + huge - 1) / huge * huge;
      if (aligned > r) ::munmap(reserved, aligned - r);
      if (const std::uintptr_t tail = r + span + huge - (aligned + span); tail > 0)
        ::munmap(reinterpret_cast<void*>(aligned + span), tail);
      at = reinterpret_cast<void*>(aligned), flags |= MAP_FIXED;  // over the reservation left: nothing else is there
    }
    void* p = ::mmap(at, size, PROT_READ | PROT_WRITE, flags, f.descriptor(), 0);
    if (p == MAP_FAILED) {
      const int error = errno;
      if (at) ::munmap(at, span);
      throw Error(Errc::resources, cat(path.string(), ": could not map its ", size, " bytes: ", std::strerror(error)));
    }
    return p;
  }
};

namespace {

// Bytes [begin, end) of a FileMapping lent to one tensor (FileMapping::lend), given back when the
// lease goes: with the tensor over them, or with a batch that failed before it made one.
class Lease {
 public:
  static std::optional<Lease> take(std::shared_ptr<const FileMapping> mapping, std::uint64_t begin, std::uint64_t end) {
    if (!mapping->lend(begin, end)) return std::nullopt;
    return Lease(std::move(mapping), begin, begin < end);
  }
  Lease(Lease&& other) noexcept
      : mapping_(std::move(other.mapping_)), begin_(other.begin_), held_(std::exchange(other.held_, false)) {}
  Lease& operator=(Lease&& other) noexcept {
    if (this != &other) {
      give_back();
      mapping_ = std::move(other.mapping_);
      begin_ = other.begin_;
      held_ = std::exchange(other.held_, false);
    }
    return *this;
  }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease() { give_back(); }
  const FileMapping& mapping() const { return *mapping_; }

 private:
  void give_back() noexcept {
    if (std::exchange(held_, false)) mapping_->give_back(begin_);
  }
  Lease(std::shared_ptr<const FileMapping> mapping, std::uint64_t begin, bool held)
      : mapping_(std::move(mapping)), begin_(begin), held_(held) {}
  std::shared_ptr<const FileMapping> mapping_;
  std::uint64_t begin_ = 0;
  bool held_ = false;
};

// One tensor's bytes inside a mapping, which lives as long as the last of them.
class MappedRows final : public Allocation {
 public:
  MappedRows(Lease lease, std::byte* at, std::size_t bytes)
      : Allocation(at, bytes, MemorySpace::host()), lease_(std::move(lease)) {}

 private:
  Lease lease_;
};

// A tensor joined from runs of the file (a fused weight's blocks, each whole rows of its own
// dataset): a reserved range of addresses in which each run is mapped, privately, right after the
// one before. Each run must start on a page of the file, and every run but the last fill whole pages.
// Registered as a FileMapping is; nullptr where it cannot be (the tensor is then read instead).
class JoinedRuns final : public Allocation {
 public:
  static std::unique_ptr<JoinedRuns> map(const io::File& f, std::span<const std::uint64_t> at,
                                         std::span<const std::size_t> bytes, const std::filesystem::path& path) {
    std::size_t total = 0;
    for (std::size_t b : bytes) total += b;
    const std::size_t reserved = round_to_page(total);
    void* base = ::mmap(nullptr, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED)
      throw Error(Errc::resources, cat(path.string(), ": could not reserve ", reserved, " bytes to map: ", std::strerror(errno)));
    std::unique_ptr<JoinedRuns> out(new JoinedRuns(static_cast<std::byte*>(base), total, reserved));
    std::size_t offset = 0;
    for (std::size_t i = 0; i < at.size(); ++i) {
      void* p = ::mmap(out->base_ + offset, round_to_page(bytes[i]), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED,
                       f.descriptor(), static_cast<off_t>(at[i]));
      if (p == MAP_FAILED)
        throw Error(Errc::resources, cat(path.string(), ": could not map ", bytes[i], " bytes at ", at[i], ": ",
                                         std::strerror(errno)));
      offset += bytes[i];
    }
    out->guard_.emplace(base, reserved, path);
    if (!out->guard_->registered()) return nullptr;
    return out;
  }
  ~JoinedRuns() override {
    guard_.reset();  // before the addresses can be someone else's
    ::munmap(base_, reserved_);
  }

 private:
  JoinedRuns(std::byte* base, std::size_t bytes, std::size_t reserved)
      : Allocation(base, bytes, MemorySpace::host()), base_(base), reserved_(reserved) {}
  std::byte* base_;
  std::size_t reserved_;
  std::optional<io::MappedRange> guard_;
};

// A part of a mapped tensor, located in the file.
struct Located {
  const Dataset* d = nullptr;
  Box box;
  std::uint64_t at = 0;    // its first byte in the file
  std::size_t bytes = 0;
  const ReaderState::Entry::SlabTable* slabs = nullptr;  // to check it against (none: unchecked)
};

// The checksums of a part's rows, one run per slab it meets (slabs from `first_slab` on, in order),
// read before the part's pages are asked for: a read of a cold checksum table queued behind
// megabytes of readahead waits for all of it.
struct PartChecksums {
  std::size_t first_slab = 0;
  Range rows;  // the part's rows
  std::vector<std::vector<std::uint64_t>> by_slab;
};

// The slabs of `p` that may meet its rows: from the first whose rows reach past its first row.
std::size_t first_slab(const Located& p) {
  const auto& reach = p.slabs->reach;
  return static_cast<std::size_t>(std::upper_bound(reach.begin(), reach.end(), p.box.rows.begin) - reach.begin());
}

// Calls f(first, n) for the run of checksums of each slab `p` may meet (n = 0 where it misses it).
template <class F>
void for_each_checksum_run(const Located& p, F&& f) {
  const std::vector<Slab>& slabs = p.slabs->slabs;
  for (std::size_t i = first_slab(p); i < slabs.size() && slabs[i].box.rows.begin < p.box.rows.end; ++i) {
    const Slab& s = slabs[i];
    const Box sub = s.box.intersect(p.box);
    if (sub.empty())
      f(std::int64_t{0}, std::int64_t{0});
    else
      f(s.first_checksum + (sub.rows.begin - s.box.rows.begin), sub.rows.size());
  }
}

// The checksums a batch needs, read in one go where they lie in one stretch of the checksum table
// (a contiguous dataset) not much longer than what is needed (a whole read at TP 1: one read of a
// megabyte or two instead of a few dozen small ones, each a wait on a cold disk); each run read on
// its own otherwise.
class ChecksumSource {
 public:
  ChecksumSource(const ReaderState& m, std::span<const Located* const> parts) : m_(m) {
    if (!m.checksums_address) return;
    std::int64_t lo = INT64_MAX, hi = 0, needed = 0;
    for (const Located* p : parts)
      for_each_checksum_run(*p, [&](std::int64_t first, std::int64_t n) {
        if (n == 0) return;
        lo = std::min(lo, first), hi = std::max(hi, first + n), needed += n;
      });
    constexpr std::int64_t slack = std::int64_t{64} << 10, most = std::int64_t{8} << 20;  // checksums
    if (needed == 0 || hi - lo > 2 * needed + slack || hi - lo > most) return;
    block_.resize(static_cast<std::size_t>(hi - lo));
    m.read_checksums(lo, hi - lo, block_.data());
    first_ = lo;
  }

  void read(std::int64_t first, std::int64_t n, std::uint64_t* out) const {
    const auto held = static_cast<std::int64_t>(block_.size());
    if (first >= first_ && first + n <= first_ + held)
      std::copy_n(block_.begin() + (first - first_), n, out);
    else
      m_.read_checksums(first, n, out);
  }

 private:
  const ReaderState& m_;
  std::vector<std::uint64_t> block_;
  std::int64_t first_ = 0;  // the checksum block_[0] is
};

PartChecksums read_part_checksums(const ChecksumSource& source, const Located& p) {
  PartChecksums out{first_slab(p), p.box.rows, {}};
  for_each_checksum_run(p, [&](std::int64_t first, std::int64_t n) {
    std::vector<std::uint64_t>& sums = out.by_slab.emplace_back(static_cast<std::size_t>(n));
    source.read(first, n, sums.data());
  });
  return out;
}

// Rows of a mapped part hashed and compared with their checksums, as one guarded call
// (io::run_guarded): nothing in it needs destroying if a lost page ends it midway.
struct HashRows {
  const std::byte* first;     // the first row's bytes
  std::size_t stride, unit;   // from one row to the next; the bytes of each hashed
  std::int64_t count;         // rows
  const std::uint64_t* want;  // their checksums
  std::int64_t first_mismatch;  // out: the first row that differs (count: none)

  static void run(void* self) {
    HashRows& j = *static_cast<HashRows*>(self);
    for (std::int64_t r = 0; r < j.count; ++r)
      if (row_hash(j.first + static_cast<std::size_t>(r) * j.stride, j.unit) != j.want[r]) {
        j.first_mismatch = r;
        return;
      }
  }
};

// The error for a page of the file's mapping (at `fault`) that could not be read: the file was cut
// short since it was mapped.
Error lost_under_mapping(const std::filesystem::path& path, std::uintptr_t fault) {
  return Error(Errc::replaced, cat(path.string(), ": the file changed under its mapping: a page of it (at address ",
                                   fault, ") could not be read (cut short by another program since it was opened)"));
}

// Every row of `p` (rows of the part `sums` were read for), which lies at `rows` in memory, checked
// against its checksum.
void verify_rows(const ReaderState& m, const Located& p, const std::byte* rows, const PartChecksums& sums,
                 const ReadOptions& options) {
  const Dataset& d = *p.d;
  const Box& box = p.box;
  const std::int64_t es = element_bytes(d.dtype), width = box.cols.size();
  const std::vector<Slab>& slabs = p.slabs->slabs;
  std::int64_t covered = 0;
  for (std::size_t i = first_slab(p); i < slabs.size() && slabs[i].box.rows.begin < box.rows.end; ++i) {
    const Slab& s = slabs[i];
    const Box sub = s.box.intersect(box);
    if (sub.empty()) continue;
    covered += box_elements(sub);
    const std::vector<std::uint64_t>& want = sums.by_slab[i - sums.first_slab];
    const std::int64_t base = std::max(s.box.rows.begin, sums.rows.begin);  // the row of want[0]
    const std::int64_t unit = s.box.cols.size() * es;
    const std::int64_t step = batch_rows(width * es, cached_read_batch);
    for (std::int64_t r0 = sub.rows.begin; r0 < sub.rows.end; r0 += step) {
      const std::int64_t end = std::min(r0 + step, sub.rows.end);
      // The rows hashed under io::run_guarded: a page of them lost to a file cut short since the
      // pager brought it in (the kernel takes such pages back from every mapping) is Errc::replaced.
      HashRows job{rows + ((r0 - box.rows.begin) * width + s.box.cols.begin - box.cols.begin) * es,
                   static_cast<std::size_t>(width * es), static_cast<std::size_t>(unit), end - r0,
                   want.data() + (r0 - base), end - r0};
      if (const std::uintptr_t fault = io::run_guarded(&HashRows::run, &job); fault != 0)
        throw lost_under_mapping(m.path, fault);
      if (job.first_mismatch < end - r0) {  // the message only then
        const std::int64_t r = r0 + job.first_mismatch;
        throw Error(Errc::corrupt, cat(m.path.string(), ": key ", d.key, ", ",
                                       rows_text({{r, r + 1}, s.box.cols}, whole_box(d.shape)),
                                       ": the bytes read differ from the bytes saved (checksum mismatch)"));
      }
      if (options.progress) options.progress((end - r0) * sub.cols.size() * es);
    }
  }
  require(covered == box_elements(box), Errc::not_a_checkpoint, m.path.string(), ": the slab table of ", d.key,
          " does not cover ", rows_text(box, whole_box(d.shape)));
}

// A run of about 1 MiB of one part's rows: the unit the threads that check a batch of mapped
// tensors take, in file order.
struct CheckRun {
  const Located* part = nullptr;
  const PartChecksums* sums = nullptr;
  const std::byte* part_rows = nullptr;  // the part's first row in memory
  Range rows;                            // the run's rows of the dataset
  std::size_t ahead = 0;                 // bytes of the batch's parts in file order before the run ends
};

// A thread that brings the pages of a batch's parts into memory in file order, as far ahead as the
// disk allows, while the threads that check the rows follow it (Pager::wait_until). It faults the
// pages in as a read of them would (MADV_POPULATE_READ, a step of 1 MiB at a time; a read of one
// byte of each page where the kernel lacks it, before Linux 5.14), so the kernel reads ahead as for
// any mapping: large folios in a pipeline, on this project's machines twice as fast as asking for
// the same pages with MADV_WILLNEED, which reads 4 KiB pages and blocks while it submits them. One
// stream: two threads taking turns at chunks of the file share its readahead state and read it
// slower than one (measured: 1 GiB, 0.53 s against 0.44 s, medians of 8). The checking threads
// then find every page in memory and mapped. A page the kernel cannot bring in (the file was cut
// short by another program since the reader mapped it) stops the stream there: a check that needs
// that page throws Errc::replaced where a read of it would have raised SIGBUS. Where no thread is
// to be had, the checking threads fault in the pages themselves.
class Pager {
 public:
  struct Span {
    const std::byte* at;
    std::size_t bytes;
    std::uint64_t file_offset;  // where the span's first byte lies in the file
  };
  Pager(std::vector<Span> spans, const std::filesystem::path& path) : spans_(std::move(spans)), path_(path) {
    try {
      thread_ = std::jthread([this](const std::stop_token& stop) { walk(stop); });
    } catch (const std::system_error&) {
      frontier_.store(SIZE_MAX);
    }
  }
  Pager(const Pager&) = delete;
  Pager& operator=(const Pager&) = delete;

  // How far the pages are in: every byte of the spans before this position (SIZE_MAX once the
  // stream has ended). It only grows, at each step of the stream.
  std::size_t frontier() const { return frontier_.load(std::memory_order_acquire); }
  // Blocks until the frontier is past `seen`.
  void wait_past(std::size_t seen) const { frontier_.wait(seen, std::memory_order_acquire); }

  // Blocks until the pages of the first `position` bytes of the spans are in memory; throws
  // Errc::replaced when one of them could not be brought in.
  void wait_until(std::size_t position) const {
    for (std::size_t now = frontier(); now < position; now = frontier()) wait_past(now);
    if (position > reached_.load(std::memory_order_acquire))
      throw Error(Errc::replaced, cat(path_.string(), ": the file changed under its mapping: its bytes from ",
                                      lost_at_.load(std::memory_order_relaxed),
                                      " could not be read (cut short by another program since it was opened)"));
  }

 private:
  static constexpr std::size_t step = std::size_t{1} << 20;

  // A read of a byte of each page of [begin, end) (`first`: begin's page), as one guarded call.
  struct Touch {
    std::uintptr_t begin, first, end, page;
    static void run(void* self) {  // volatile: each read happens though its byte goes unused
      const Touch& t = *static_cast<const Touch*>(self);
      (void)*reinterpret_cast<const volatile unsigned char*>(t.begin);
      for (std::uintptr_t q = t.first + t.page; q < t.end; q += t.page) (void)*reinterpret_cast<const volatile unsigned char*>(q);
    }
  };

  void publish(std::size_t position) {
    frontier_.store(position, std::memory_order_release);
    frontier_.notify_all();
  }

  void walk(const std::stop_token& stop) {
    const auto page = static_cast<std::uintptr_t>(page_bytes());
    bool populate = true;
    std::size_t position = 0;
    for (const Span& s : spans_) {
      for (std::size_t at = 0; at < s.bytes;) {
        if (stop.stop_requested()) return publish(SIZE_MAX);
        const std::size_t n = std::min(step, s.bytes - at);
        const auto begin = reinterpret_cast<std::uintptr_t>(s.at + at), end = begin + n;
        const std::uintptr_t first = begin / page * page, last = (end + page - 1) / page * page;
        if (populate && ::madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_READ) != 0) {
          if (errno == EFAULT) return lost(position, s.file_offset + at);
          populate = false;  // not in this kernel (EINVAL), or not now: read a byte of each page instead
        }
        if (!populate) {  // a read of a byte of each page, guarded: a lost page ends the stream
          Touch touch{begin, first, end, page};
          if (io::run_guarded(&Touch::run, &touch) != 0) return lost(position, s.file_offset + at);
        }
        at += n;
        position += n;
        publish(position);
      }
    }
    publish(SIZE_MAX);
  }

  // The byte at `position` (`file_offset` in the file) could not be brought in: no check may go
  // past it. The stream ends; the checks before it go on.
  void lost(std::size_t position, std::uint64_t file_offset) {
    lost_at_.store(file_offset, std::memory_order_relaxed);
    reached_.store(position, std::memory_order_release);
    publish(SIZE_MAX);
  }

  std::vector<Span> spans_;
  const std::filesystem::path& path_;
  mutable std::atomic<std::size_t> frontier_{0};  // the stream's next byte to bring in
  std::atomic<std::size_t> reached_{SIZE_MAX};    // the first byte that could not be brought in
  std::atomic<std::uint64_t> lost_at_{0};
  std::jthread thread_;  // last: asked to stop and joined first, before the members it reads go
};

// The runs of every checked part, checked as verify_rows checks them, in file order behind the
// pager: by the calling thread, and by up to one more thread per core (8 in all at most) where it
// falls behind. Hashing every byte is the one CPU cost of a mapped read. The first mismatch in file
// order is the one reported; `options.progress` is called by one thread at a time.
void check_runs(const ReaderState& m, std::span<const CheckRun> runs, const Pager& pager, const ReadOptions& options) {
  const auto count = static_cast<std::int64_t>(runs.size());
  static const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());  // asked once
  const std::int64_t threads = std::min<std::int64_t>({cores, 8, count / 4});
  std::mutex lock;  // progress, and the first failure
  ReadOptions each = options;
  if (options.progress && threads > 1)
    each.progress = [&](std::int64_t bytes) {
      const std::lock_guard hold(lock);
      options.progress(bytes);
    };
  std::atomic<std::int64_t> next{0};
  std::int64_t failed_run = count;
  std::exception_ptr failure;
  const auto check = [&](std::int64_t r) {  // run r checked, or its failure kept if first in file order
    const CheckRun& run = runs[static_cast<std::size_t>(r)];
    try {
      pager.wait_until(run.ahead);
      Located sub = *run.part;
      sub.box.rows = run.rows;
      const std::int64_t row_bytes = sub.box.cols.size() * element_bytes(sub.d->dtype);
      verify_rows(m, sub, run.part_rows + (run.rows.begin - run.part->box.rows.begin) * row_bytes, *run.sums, each);
    } catch (...) {
      const std::lock_guard hold(lock);
      if (r < failed_run) failed_run = r, failure = std::current_exception();
      next = count;  // the others stop at their next run
    }
  };
  // The calling thread checks the runs in file order as their pages come in. The others help only
  // where it falls behind, the pages in memory more than `lag` past the next run to check (a disk
  // faster than a core hashes): on a slower disk they would only take the cores that the pager and
  // the kernel's reads need (measured: 1 GiB cold on 2 cores, 0.45 s with one checking thread
  // against 0.51 s with two). The lag is past the kernel's readahead (8 MiB on this project's
  // machines), which brings pages in by the megabyte at a time whatever the disk's pace.
  constexpr std::size_t lag = std::size_t{32} << 20;
  const auto help = [&] {
    for (;;) {
      const std::size_t in = pager.frontier();
      const std::int64_t r = next.load();
      if (r >= count) return;
      if (in < runs[static_cast<std::size_t>(r)].ahead + lag) {
        pager.wait_past(in);
        continue;
      }
      if (const std::int64_t mine = next++; mine < count) check(mine);
    }
  };
  {
    std::vector<std::jthread> helpers;
    for (std::int64_t t = 1; t < threads; ++t) {
      try {
        helpers.emplace_back(help);
      } catch (const std::system_error&) {  // no thread to be had: fewer check the rows
        break;
      }
    }
    for (std::int64_t r = next++; r < count; r = next++) check(r);
  }
  if (failure) std::rethrow_exception(failure);
}

// The memory a tensor's parts are mapped into: the reader's mapping of the whole file (one part), or
// runs of it joined (several).
struct Mapping {
  std::optional<Lease> whole;
  std::unique_ptr<JoinedRuns> joined;
};

// Finds each part in the file and maps them: nothing when one cannot be mapped (its tensor is then
// read into memory instead).
std::optional<Mapping> locate_and_map(const ReaderState& m, std::vector<Located>& located, std::int64_t es,
                                      const ReadOptions& options) {
  for (std::size_t i = 0; i < located.size(); ++i) {
    Located& p = located[i];
    const ReaderState::Entry& e = m.tensor_entry(p.d->key);
    if (e.external) return std::nullopt;  // its bytes are in another file
    const std::vector<RawRegion>& regions = m.regions_for(e);
    // One contiguous region of the whole dataset (not chunked, not filtered, the library's byte
    // order: regions_for is empty otherwise), rows as wide as the dataset's.
    if (regions.size() != 1 || regions[0].runs != 1 || regions[0].box != whole_box(p.d->shape) ||
        p.box.cols != regions[0].box.cols)
      return std::nullopt;
    p.at = regions[0].address + static_cast<std::uint64_t>(p.box.rows.begin * p.box.cols.size() * es);
    if (p.at % static_cast<std::uint64_t>(es) != 0) return std::nullopt;  // elements must lie aligned in memory
    if (options.verify && m.checksummed) p.slabs = &m.slabs_for(e);
  }
  // Parts that follow one another in the file (a fused weight's blocks as a save lays them out) are
  // one range of the file's mapping, as one part is.
  bool adjacent = true;
  for (std::size_t i = 1; i < located.size(); ++i)
    adjacent = adjacent && located[i].at == located[i - 1].at + located[i - 1].bytes;
  Mapping out;
  if (adjacent) {
    std::shared_ptr<FileMapping> whole =
        m.mapping.get([&] { return std::make_shared<FileMapping>(m.file, m.file_size, m.path); });
    if (!whole->guarded()) return std::nullopt;  // too many mappings registered: read instead
    // Bytes another tensor alive lies over: read instead, so that the two never share memory.
    out.whole = Lease::take(std::move(whole), located.front().at, located.back().at + located.back().bytes);
    if (!out.whole) return std::nullopt;
    return out;
  }
  // Joined runs: each on a page of the file, all but the last whole pages.
  for (std::size_t i = 0; i < located.size(); ++i)
    if (located[i].at % page_bytes() != 0 || (i + 1 < located.size() && located[i].bytes % page_bytes() != 0))
      return std::nullopt;
  const std::uint64_t now = m.file.size();
  require(now == m.file_size, Errc::replaced, m.path.string(), ": the file changed since it was opened (", m.file_size,
          " bytes then, ", now, " now): nothing is mapped");
  std::vector<std::uint64_t> at;
  std::vector<std::size_t> bytes;
  for (const Located& p : located) at.push_back(p.at), bytes.push_back(p.bytes);
  out.joined = JoinedRuns::map(m.file, at, bytes, m.path);
  if (!out.joined) return std::nullopt;  // too many mappings registered: read instead
  return out;
}

// A tensor of a batch, its parts found and mapped, not yet checked.
struct Prepared {
  std::vector<Located> located;
  Mapping mapping;
  std::byte* rows = nullptr;  // its first byte in memory
  std::size_t bytes = 0;
  std::vector<std::size_t> offsets;  // of each part in the tensor
  std::vector<PartChecksums> sums;   // of each part (empty where unchecked)
};

std::optional<Prepared> prepare(const ReaderState& m, const MapRequest& request, const ReadOptions& options) {
  const std::int64_t es = element_bytes(request.dtype);
  Prepared out;
  for (const MapPart& part : request.parts) {
    require(part.dataset != nullptr && part.dataset->dtype == request.dtype, Errc::invalid_argument, m.path.string(),
            ": a mapped tensor's parts must be datasets of its dtype ", dtype_name(request.dtype));
    const auto bytes = static_cast<std::size_t>(box_elements(part.box) * es);
    check_box(*part.dataset, part.box, request.dtype, bytes, m.path);
    if (part.box.empty()) return std::nullopt;
    out.offsets.push_back(out.bytes);
    out.located.push_back({part.dataset, part.box, 0, bytes, nullptr});
    out.bytes += bytes;
  }
  const auto want = static_cast<std::size_t>(request.shape.elements()) * dtype_size(request.dtype);
  require(out.bytes == want, Errc::invalid_argument, m.path.string(), ": the parts of a mapped tensor hold ", out.bytes,
          " bytes, its shape ", dims_text(request.shape.dims()), " holds ", want);
  std::optional<Mapping> mapped = locate_and_map(m, out.located, es, options);
  if (!mapped) return std::nullopt;
  out.mapping = std::move(*mapped);
  // regions_for checked each region against the file's size at the open, which the mapping matches.
  out.rows = out.mapping.whole ? out.mapping.whole->mapping().base + out.located.front().at : out.mapping.joined->data();
  return out;
}

}  // namespace

std::vector<std::optional<SharedBuffer>> CheckpointReader::map_all(std::span<const MapRequest> requests,
                                                                   ReadOptions options) const {
  const ReaderState& m = *impl_;
  std::vector<std::optional<Prepared>> prepared(requests.size());
  if (options.method == IoMethod::raw && !options.bypass_page_cache)
    for (std::size_t i = 0; i < requests.size(); ++i)
      if (!requests[i].parts.empty()) prepared[i] = prepare(m, requests[i], options);
  // Every part of the batch in file order, whatever the order of the tensors and of the parts in a
  // tensor (a fused weight's blocks follow its rows, the file their keys): the kernel's readahead
  // then sees one sequential stream.
  struct Ref {
    Prepared* t;
    std::size_t part;
  };
  std::vector<Ref> order;
  for (std::optional<Prepared>& t : prepared)
    if (t)
      for (std::size_t i = 0; i < t->located.size(); ++i) order.push_back({&*t, i});
  std::sort(order.begin(), order.end(), [](const Ref& a, const Ref& b) {
    const std::uint64_t x = a.t->located[a.part].at, y = b.t->located[b.part].at;
    if (x != y) return x < y;
    return std::less<>{}(a.t, b.t) || (a.t == b.t && a.part < b.part);  // the same bytes twice: request order
  });
  // The checksums, read before any page is asked for (ChecksumSource: in one go where they lie
  // together): a read of a cold checksum table queued behind megabytes of readahead waits for all of it.
  for (std::optional<Prepared>& t : prepared)
    if (t) t->sums.resize(t->located.size());
  std::vector<const Located*> checked;
  for (const Ref& r : order)
    if (r.t->located[r.part].slabs) checked.push_back(&r.t->located[r.part]);
  const ChecksumSource source(m, checked);
  for (const Ref& r : order)
    if (r.t->located[r.part].slabs) r.t->sums[r.part] = read_part_checksums(source, r.t->located[r.part]);
  std::vector<Pager::Span> spans;
  std::vector<CheckRun> runs;
  std::size_t position = 0;
  constexpr std::int64_t run_bytes = std::int64_t{1} << 20;
  for (const Ref& r : order) {
    const Located& p = r.t->located[r.part];
    const std::byte* rows = r.t->rows + r.t->offsets[r.part];
    spans.push_back({rows, p.bytes, p.at});
    if (!p.slabs) {
      position += p.bytes;
      continue;
    }
    const std::int64_t row_bytes = p.box.cols.size() * element_bytes(p.d->dtype);
    const std::int64_t step = batch_rows(row_bytes, run_bytes);  // rows per run
    for (std::int64_t row = p.box.rows.begin; row < p.box.rows.end; row += step) {
      const Range rows_of_run{row, std::min(row + step, p.box.rows.end)};
      position += static_cast<std::size_t>(rows_of_run.size() * row_bytes);
      runs.push_back({&p, &r.t->sums[r.part], rows, rows_of_run, position});
    }
  }
  if (!runs.empty()) {
    const Pager pager(std::move(spans), m.path);
    check_runs(m, runs, pager, options);
  }
  std::vector<std::optional<SharedBuffer>> out(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (!prepared[i]) continue;
    Prepared& t = *prepared[i];
    if (options.progress)
      for (const Located& p : t.located)
        if (!p.slabs) options.progress(static_cast<std::int64_t>(p.bytes));
    if (t.mapping.whole)
      out[i] = SharedBuffer(std::make_shared<MappedRows>(std::move(*t.mapping.whole), t.rows, t.bytes), requests[i].dtype,
                            requests[i].shape);
    else
      out[i] = SharedBuffer(std::shared_ptr<Allocation>(std::move(t.mapping.joined)), requests[i].dtype, requests[i].shape);
  }
  return out;
}

std::optional<SharedBuffer> CheckpointReader::map(std::span<const MapPart> parts, DType dtype, Extents shape,
                                                  ReadOptions options) const {
  const MapRequest request{parts, dtype, std::move(shape)};
  return std::move(map_all(std::span<const MapRequest>(&request, 1), options).front());
}

std::optional<SharedBuffer> CheckpointReader::map(const Dataset& d, const Box& box, Extents shape,
                                                  ReadOptions options) const {
  const MapPart part{&d, box};
  return map(std::span<const MapPart>(&part, 1), d.dtype, std::move(shape), options);
}

}  // namespace shardckpt
