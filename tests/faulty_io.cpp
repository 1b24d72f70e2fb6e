// An LD_PRELOAD shim that makes the writes to chosen files fail or fall short, for the fault tests in
// cli_test.sh (EIO and short writes cannot be produced on demand by a real filesystem). It only acts
// on descriptors whose path contains $FAULTY_IO_PATH:
//   FAULTY_IO_ERRNO=EIO|ENOSPC|EFBIG  writes fail with this error once $FAULTY_IO_AFTER bytes
//                                     (default 0) went to the chosen files
//   FAULTY_IO_FSYNC=EIO|...           fsync fails with this error
//   FAULTY_IO_SHORT=1                 every write moves at most half of what it is asked (at least
//                                     one byte): a correct writer still finishes
//   FAULTY_IO_DIRECT=EINVAL|EIO       reads through O_DIRECT descriptors fail with this error (EINVAL
//                                     is how a file system refuses direct reads it cannot align)
// Both pwrite and pwrite64 (pread and pread64) are wrapped: without this, the headers would alias one to the other.
#undef _FILE_OFFSET_BITS
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace {

std::atomic<long long> written{0};

int configured_errno(const char* variable) {
  const char* e = std::getenv(variable);
  if (!e) return 0;
  if (std::strcmp(e, "EIO") == 0) return EIO;
  if (std::strcmp(e, "ENOSPC") == 0) return ENOSPC;
  if (std::strcmp(e, "EFBIG") == 0) return EFBIG;
  if (std::strcmp(e, "EINVAL") == 0) return EINVAL;
  return EIO;
}

bool chosen(int fd) {
  const char* want = std::getenv("FAULTY_IO_PATH");
  if (!want || !*want) return false;
  char link[64], target[4096];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  return std::strstr(target, want) != nullptr;
}

// The error this write fails with, or 0.
int fault(int fd, size_t n) {
  if (!chosen(fd)) return 0;
  const int err = configured_errno("FAULTY_IO_ERRNO");
  const char* after = std::getenv("FAULTY_IO_AFTER");
  const long long limit = after ? std::atoll(after) : 0;
  if (err && written.load() + static_cast<long long>(n) > limit) return err;
  written += static_cast<long long>(n);
  return 0;
}

size_t shortened(int fd, size_t n) {
  if (n > 1 && std::getenv("FAULTY_IO_SHORT") && chosen(fd)) return n / 2;
  return n;
}

template <class Fn>
Fn next(const char* name) {
  return reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" {

ssize_t pwrite64(int fd, const void* buf, size_t n, off64_t offset) {
  static auto real = next<ssize_t (*)(int, const void*, size_t, off64_t)>("pwrite64");
  if (const int err = fault(fd, n)) {
    errno = err;
    return -1;
  }
  return real(fd, buf, shortened(fd, n), offset);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t offset) { return pwrite64(fd, buf, n, offset); }

ssize_t write(int fd, const void* buf, size_t n) {
  static auto real = next<ssize_t (*)(int, const void*, size_t)>("write");
  if (const int err = fault(fd, n)) {
    errno = err;
    return -1;
  }
  return real(fd, buf, shortened(fd, n));
}

ssize_t pread64(int fd, void* buf, size_t n, off64_t offset) {
  static auto real = next<ssize_t (*)(int, void*, size_t, off64_t)>("pread64");
  if (const int err = configured_errno("FAULTY_IO_DIRECT"); err && (::fcntl(fd, F_GETFL) & O_DIRECT) && chosen(fd)) {
    errno = err;
    return -1;
  }
  return real(fd, buf, n, offset);
}

ssize_t pread(int fd, void* buf, size_t n, off_t offset) { return pread64(fd, buf, n, offset); }

int fsync(int fd) {
  static auto real = next<int (*)(int)>("fsync");
  if (const int err = configured_errno("FAULTY_IO_FSYNC"); err && chosen(fd)) {
    errno = err;
    return -1;
  }
  return real(fd);
}
}
