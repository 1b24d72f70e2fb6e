// Durability: a save that cannot write (a full filesystem, a file-size limit) fails on every rank with
// Errc::io, leaves the earlier checkpoint byte for byte as it was and no partial file behind, and
// the process exits normally afterwards (HDF5 once crashed at exit over a file it could not flush).
// Each case runs in a child process: the limits are per process, and the exit is what is tested.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "test_support.hpp"
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::file_bytes;
using testing_support::ScratchDir;

namespace {

demo::ModelConfig model(std::int64_t cols) {
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 1;
  c.dims = {.heads = 4, .head_dim = 4, .groups = 2, .state = 4, .householder = 2};
  c.cols = cols;
  return c;
}

constexpr demo::Layout layout{2, 2, 8, 1};

// Every rank's error code of a save (none where it succeeded).
std::vector<std::optional<Errc>> save_everywhere(const demo::ModelConfig& c, const std::filesystem::path& path,
                                                 IoMethod method, std::string* message) {
  std::vector<std::optional<Errc>> codes(static_cast<std::size_t>(layout.ranks()));
  std::mutex m;
  try {
    run_ranks(layout.ranks(), [&](ProcessGroup& g) {
      demo::RankModel rank = demo::build_rank(c, layout, g.rank());
      try {
        save(rank.state, path, g, {.method = method});
      } catch (const Error& e) {
        const std::lock_guard lock(m);
        codes[static_cast<std::size_t>(g.rank())] = e.code();
        if (message && message->empty()) *message = e.what();
        throw;
      }
    });
  } catch (const Error&) {
  }
  return codes;
}

// Runs `body` in a child process; returns its wait status.
int in_child(const std::function<bool()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    bool ok = false;
    try {
      ok = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    std::exit(ok ? 0 : 1);  // a normal exit: HDF5's atexit shutdown runs here
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// In the child: saves a small checkpoint, then a large one that cannot fit; checks that every rank
// failed with Errc::io naming `reason`, the small checkpoint is intact and no partial file is left.
bool large_save_fails_cleanly(const std::filesystem::path& path, IoMethod method, const std::string& reason) {
  (void)save_everywhere(model(8), path, method, nullptr);
  const std::string before = file_bytes(path);
  if (before.empty()) return false;
  std::string message;
  const auto codes = save_everywhere(model(4096), path, method, &message);
  bool ok = true;
  for (std::size_t r = 0; r < codes.size(); ++r)
    if (codes[r] != Errc::io) {
      std::fprintf(stderr, "child: rank %zu did not fail with Errc::io\n", r);
      ok = false;
    }
  if (message.find(reason) == std::string::npos) {
    std::fprintf(stderr, "child: the error does not say '%s': %s\n", reason.c_str(), message.c_str());
    ok = false;
  }
  if (file_bytes(path) != before) {
    std::fprintf(stderr, "child: the earlier checkpoint changed\n");
    ok = false;
  }
  if (!testing_support::temporary_files(path.parent_path()).empty()) {
    std::fprintf(stderr, "child: a temporary file was left behind in %s\n", path.parent_path().c_str());
    ok = false;
  }
  const LoadedState loaded = load(path, demo::request(model(8), layout, 0));
  return ok && demo::verify(model(8), {}, 0, demo::request(model(8), layout, 0), loaded).mismatches == 0;
}

}  // namespace

TEST(Durability, AFileSizeLimitFailsTheSaveOnEveryRankAndKeepsTheEarlierCheckpoint) {
  for (IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
    ScratchDir dir;
    const int status = in_child([&] {
      // Room for the small checkpoint, not for the large one: writes past it fail with EFBIG
      // (SIGXFSZ is ignored by the library, so the process lives to report it).
      const rlimit limit{256 * 1024, 256 * 1024};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return false;
      return large_save_fails_cleanly(dir / "ckpt.h5", method, "File too large");
    });
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << (method == IoMethod::raw ? "raw" : "hyperslab") << ": status " << status;
  }
}

TEST(Durability, AFullFilesystemFailsTheSaveOnEveryRankAndKeepsTheEarlierCheckpoint) {
  ScratchDir dir;
  const std::filesystem::path mount = dir / "fs";
  std::filesystem::create_directory(mount);
  // A 384 KiB tmpfs: the small checkpoint fits, the large one does not.
  if (::getuid() != 0 || ::mount("tmpfs", mount.c_str(), "tmpfs", 0, "size=384k") != 0)
    GTEST_SKIP() << "mounting a tmpfs needs root (the file-size-limit test covers the rest)";
  for (IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
    const int status = in_child([&] { return large_save_fails_cleanly(mount / "ckpt.h5", method, "No space left"); });
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << (method == IoMethod::raw ? "raw" : "hyperslab") << ": status " << status;
    std::filesystem::remove(mount / "ckpt.h5");
  }
  ::umount(mount.c_str());
}

// A rank thread that cannot be started is a typed error, after the started ranks were stopped and
// joined (it was std::terminate). The address-space limit that makes thread stacks fail conflicts
// with the sanitizers' own mappings: the test runs in the plain build only.
TEST(Durability, ARankThreadThatCannotStartIsATypedError) {
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "an address-space limit cannot be combined with AddressSanitizer";
#endif
#endif
  const int status = in_child([] {
    rlimit limit{};
    ::getrlimit(RLIMIT_AS, &limit);
    // Room for what the process holds now and a few thread stacks, not 256.
    std::ifstream statm("/proc/self/statm");
    std::uint64_t pages = 0;
    statm >> pages;
    limit.rlim_cur = pages * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)) + (64 << 20);
    if (::setrlimit(RLIMIT_AS, &limit) != 0) return false;
    try {
      run_ranks(256, [](ProcessGroup& g) { g.barrier(); });
    } catch (const Error& e) {
      return e.code() == Errc::collective && std::string(e.what()).find("could not start the thread") != std::string::npos;
    }
    return false;
  });
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}
