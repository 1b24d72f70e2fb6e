module;
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>
module shardckpt.io;

namespace shardckpt::io {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(std::string_view op, const fs::path& file, int err) {
  throw Error(Errc::io, cat("could not ", op, " ", file.string(), ": ", std::strerror(err)));
}

[[noreturn]] void fail_at(std::string_view op, const fs::path& file, std::size_t n, std::uint64_t offset, int err) {
  throw Error(Errc::io,
              cat("could not ", op, " ", n, " bytes at byte ", offset, " of ", file.string(), ": ", std::strerror(err)));
}

// A file-size limit (ulimit -f) kills a process with SIGXFSZ by default; ignored, the write
// fails with EFBIG and the save reports it like any other write error. Only a default
// disposition is changed: a handler the application installed stays.
void ignore_sigxfsz() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current{};
    if (::sigaction(SIGXFSZ, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      struct sigaction ignore{};
      ignore.sa_handler = SIG_IGN;
      ::sigemptyset(&ignore.sa_mask);
      ::sigaction(SIGXFSZ, &ignore, nullptr);
    }
  });
}

int open_fd(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) fail("open", path, errno);
  return fd;
}

// Transfers are split so that one call never asks for more than the kernel moves at once.
constexpr std::size_t max_transfer = std::size_t{1} << 30;

}  // namespace

File File::open_read(const fs::path& path) { return File(open_fd(path, O_RDONLY), path); }

File File::open_write(const fs::path& path) {
  ignore_sigxfsz();
  return File(open_fd(path, O_WRONLY), path);
}

File File::open_update(const fs::path& path) {
  ignore_sigxfsz();
  return File(open_fd(path, O_RDWR), path);
}

File File::create(const fs::path& path) {
  ignore_sigxfsz();
  return File(open_fd(path, O_RDWR | O_CREAT | O_TRUNC), path);
}

File::File(File&& other) noexcept : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

FileIdentity File::identity() const {
  struct stat st{};
  if (::fstat(fd_, &st) != 0) fail("inspect", path_, errno);
  return {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

std::uint64_t File::size() const {
  struct stat st{};
  if (::fstat(fd_, &st) != 0) fail("inspect", path_, errno);
  return static_cast<std::uint64_t>(st.st_size);
}

namespace {
std::atomic<std::uint64_t> bytes_read{0}, bytes_written{0};
}  // namespace

IoStats io_stats() noexcept { return {bytes_read.load(), bytes_written.load()}; }

std::size_t File::pread_upto(void* dst, std::size_t n, std::uint64_t offset) const {
  auto* p = static_cast<std::byte*>(dst);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, p + done, std::min(n - done, max_transfer), static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail_at("read", path_, n, offset, errno);
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  bytes_read.fetch_add(done, std::memory_order_relaxed);
  return done;
}

void File::pread_all(void* dst, std::size_t n, std::uint64_t offset) const {
  const std::size_t got = pread_upto(dst, n, offset);
  require(got == n, Errc::not_a_checkpoint, path_.string(), " ends at byte ", offset + got, " but ", n,
          " bytes are needed at byte ", offset, " (truncated)");
}

void File::pwrite_all(const void* src, std::size_t n, std::uint64_t offset) {
  const auto* p = static_cast<const std::byte*>(src);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t put = ::pwrite(fd_, p + done, std::min(n - done, max_transfer), static_cast<off_t>(offset + done));
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) fail_at("write", path_, n, offset, errno);
    // A write that moves nothing would loop forever; POSIX leaves its cause unsaid (a full device).
    if (put == 0) fail_at("write", path_, n, offset, ENOSPC);
    done += static_cast<std::size_t>(put);
  }
  bytes_written.fetch_add(done, std::memory_order_relaxed);
}

void File::truncate(std::uint64_t size) {
  while (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
    if (errno != EINTR) fail(cat("resize to ", size, " bytes"), path_, errno);
}

void File::sync() {
  if (::fsync(fd_) != 0) fail("flush to disk", path_, errno);
}

void File::close() {
  const int fd = std::exchange(fd_, -1);
  if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) fail("close", path_, errno);
}

void sync_directory(const fs::path& dir) {
  const fs::path d = dir.empty() ? fs::path(".") : dir;
  const int fd = open_fd(d, O_RDONLY | O_DIRECTORY);
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0) fail("flush to disk", d, err);
}

void rename_durably(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw Error(Errc::io, cat("could not rename ", from.string(), " to ", to.string(), ": ", std::strerror(errno)));
  sync_directory(to.parent_path());
}

void remove_quietly(const fs::path& path) noexcept {
  std::error_code ec;
  fs::remove(path, ec);
}

fs::path follow_links(const fs::path& path) {
  fs::path p = path;
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    if (!fs::is_symlink(fs::symlink_status(p, ec))) return p;
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) throw Error(Errc::io, cat("could not read the link ", p.string(), ": ", ec.message()));
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  throw Error(Errc::io, cat("could not follow ", path.string(), ": too many levels of symbolic links"));
}

std::string random_id() {
  unsigned char bits[16];
  std::size_t got = 0;
  while (got < sizeof bits) {
    const ssize_t n = ::getrandom(bits + got, sizeof bits - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(Errc::io, cat("could not draw a checkpoint id: ", std::strerror(errno)));
    got += static_cast<std::size_t>(n);
  }
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bits) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

}  // namespace shardckpt::io
