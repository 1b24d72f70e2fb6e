// shardckpt.storage:os (implementation partition): what the units of storage:file share of the
// operating system: errors named after the file and the operation, the disposition of SIGXFSZ, plain
// opens, the largest transfer one call asks for, and the process's byte counters. Nothing here
// opens a name someone else may have planted: storage:file does that, with its checks.
module;
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string_view>
module shardckpt.storage:os;
import shardckpt.core;

namespace shardckpt::io {

// Running out of descriptors or kernel memory is no I/O error of the file.
inline Errc code_of(int err) { return err == EMFILE || err == ENFILE || err == ENOMEM ? Errc::resources : Errc::io; }

[[noreturn]] inline void fail(std::string_view op, const std::filesystem::path& file, int err) {
  throw Error(code_of(err), cat("could not ", op, " ", file.string(), ": ", std::strerror(err)));
}

[[noreturn]] inline void fail_at(std::string_view op, const std::filesystem::path& file, std::size_t n, std::uint64_t offset, int err) {
  throw Error(Errc::io,
              cat("could not ", op, " ", n, " bytes at byte ", offset, " of ", file.string(), ": ", std::strerror(err)));
}

// A file-size limit (ulimit -f) kills a process with SIGXFSZ by default; ignored, the write
// fails with EFBIG and the save reports it like any other write error. Only a default
// disposition is changed: a handler the application installed stays.
inline void ignore_sigxfsz() {
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

inline int open_fd(const std::filesystem::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) fail("open", path, errno);
  return fd;
}

// Transfers are split so that one call never asks for more than the kernel moves at once.
inline constexpr std::size_t max_transfer = std::size_t{1} << 30;


// Bytes read and written through every File of this process (io_stats).
inline std::atomic<std::uint64_t> bytes_read{0}, bytes_written{0};

}  // namespace shardckpt::io
