// Clocks, peak memory, the page cache and the plain-I/O baselines of shardckpt-bench.
#include <fcntl.h>
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "bench.hpp"

namespace bench {
namespace {

bool write_proc(const char* file, const char* text) {
  const int fd = ::open(file, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text, std::strlen(text)) == static_cast<ssize_t>(std::strlen(text));
  ::close(fd);
  return ok;
}

void write_all(int fd, const std::byte* p, std::size_t n) {
  while (n > 0) {
    const ssize_t done = ::write(fd, p, std::min<std::size_t>(n, std::size_t{1} << 30));
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0) die("raw write");
    p += done;
    n -= static_cast<std::size_t>(done);
  }
}

// Reads the whole file into `buffer`, `window` bytes at a time (from its start each time when the
// buffer is reused, else on from the last read); returns the bytes read.
std::int64_t read_file(const fs::path& file, std::byte* buffer, std::size_t window, bool reuse) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) die("open " + file.string());
  std::int64_t done = 0;
  for (;;) {
    const ssize_t n = ::read(fd, reuse ? buffer : buffer + done, window);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die("read " + file.string());
    if (n == 0) break;
    done += n;
  }
  ::close(fd);
  return done;
}

}  // namespace

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double fastest(const std::vector<double>& v) { return v.empty() ? 0 : *std::min_element(v.begin(), v.end()); }

void die(const std::string& what) { throw Error(Errc::io, cat(what, ": ", std::strerror(errno))); }

std::int64_t proc_status_bytes(std::string_view field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(field.size())) * 1024;
  return 0;
}

void remove_file(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);
}

void parallel_for(int n, const std::function<void(int)>& fn) {
  std::atomic<int> next{0};
  std::vector<std::thread> workers;
  for (unsigned w = 0; w < std::max(1u, std::thread::hardware_concurrency()); ++w)
    workers.emplace_back([&] {
      for (int i; (i = next++) < n;) fn(i);
    });
  for (auto& w : workers) w.join();
}

PeakMeter::PeakMeter() { exact_ = write_proc("/proc/self/clear_refs", "5"); }

const char* PeakMeter::method() const {
  return exact_ ? "VmHWM reset by /proc/self/clear_refs" : "VmRSS sampled every 1 ms";
}

void PeakMeter::begin() {
  ::malloc_trim(0);  // freed heap of earlier phases must not be reused silently by this one
  rss0_ = proc_status_bytes("VmRSS:");
  if (exact_) {
    if (!write_proc("/proc/self/clear_refs", "5")) die("resetting VmHWM");
    return;
  }
  max_ = rss0_;
  stop_ = false;
  sampler_ = std::thread([this] {
    while (!stop_) {
      max_ = std::max<std::int64_t>(max_, proc_status_bytes("VmRSS:"));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
}

std::int64_t PeakMeter::end() {
  std::int64_t peak = 0;
  if (exact_) {
    peak = proc_status_bytes("VmHWM:");
  } else {
    stop_ = true;
    sampler_.join();
    peak = std::max<std::int64_t>(max_, proc_status_bytes("VmRSS:"));
  }
  return std::max<std::int64_t>(0, peak - rss0_);
}

Cache::Cache(fs::path dir) : dir_(std::move(dir)) {
  ::sync();
  drop_ = write_proc("/proc/sys/vm/drop_caches", "3");
}

const char* Cache::method() const {
  return drop_ ? "sync + echo 3 > /proc/sys/vm/drop_caches" : "fdatasync + posix_fadvise(DONTNEED)";
}

void Cache::cold() const {
  ::sync();
  if (drop_ && write_proc("/proc/sys/vm/drop_caches", "3")) return;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

void raw_write(const fs::path& file, const std::vector<SavePlan>& plans) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) die("open " + file.string());
  for (const SavePlan& plan : plans)
    for (const SaveItem& i : plan.items)
      if (i.writes) write_all(fd, i.data.data(), i.data.bytes());
  if (::fsync(fd) != 0) die("fsync " + file.string());
  ::close(fd);
}

std::int64_t raw_read(const fs::path& file) {
  HostBuffer buf = HostBuffer::uninitialized(DType::u8, {static_cast<std::int64_t>(fs::file_size(file))});
  return read_file(file, buf.mut_view().data(), std::size_t{8} << 20, false);
}

std::int64_t raw_read_reused(const fs::path& file) {
  HostBuffer buf = HostBuffer::zeros(DType::u8, {std::int64_t{8} << 20});
  return read_file(file, buf.mut_view().data(), buf.bytes(), true);
}

}  // namespace bench
