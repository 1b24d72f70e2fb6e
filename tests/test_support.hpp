// Helpers shared by the test suites: scratch directories and file contents. No shardckpt types
// here, so that suites can include it before their imports.
#pragma once
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace testing_support {

// A fresh directory, removed with everything in it when the object goes.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "shardckpt-test-XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The temporary files of saves (`.<name>.<32 hex digits>.partial`) in `dir`.
inline std::vector<std::string> temporary_files(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 42 && name[0] == '.' && name.ends_with(".partial")) out.push_back(name);
  }
  return out;
}

inline bool contains(std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; }

inline std::string file_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Whether this file system takes O_DIRECT opens at all (tmpfs did not before Linux 6.6).
inline bool direct_io_possible(const std::filesystem::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// Pages of `path` in the page cache after it was dropped from it and `read` ran.
inline std::size_t cached_pages_after(const std::filesystem::path& path, const std::function<void()>& read) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  ::fdatasync(fd);
  EXPECT_EQ(0, ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED));
  read();
  const auto size = static_cast<std::size_t>(std::filesystem::file_size(path));
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  EXPECT_NE(map, MAP_FAILED);
  std::vector<unsigned char> resident((size + 4095) / 4096);
  EXPECT_EQ(0, ::mincore(map, size, resident.data()));
  ::munmap(map, size);
  ::close(fd);
  return static_cast<std::size_t>(
      std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return r & 1; }));
}

// h5py and numpy exist only for the system python.
inline constexpr const char* python = "/usr/bin/python3";

inline bool have_python_module(const std::string& module) {
  return std::system((std::string(python) + " -c 'import " + module + "' 2> /dev/null").c_str()) == 0;
}

// Runs a python script (its text) with arguments; returns its exit status.
inline int run_python(const std::string& script, const std::string& args = "") {
  char name[] = "/tmp/shardckpt-test-py-XXXXXX";
  const int fd = ::mkstemp(name);
  if (fd < 0) return -1;
  ::close(fd);
  std::ofstream(name) << script;
  const int rc = std::system((std::string(python) + " " + name + " " + args).c_str());
  std::filesystem::remove(name);
  return rc;
}

// True when two checkpoints hold the same tensors, element by element (their metadata, with the
// unique checkpoint id and the slabs of the layout that saved them, aside).
inline bool same_tensors(const std::filesystem::path& a, const std::filesystem::path& b) {
  return std::system(("h5diff --exclude-path /_shardckpt " + a.string() + " " + b.string() + " > /dev/null").c_str()) ==
         0;
}

// True when two checkpoints saved at the same layout also hold the same checksums.
inline bool same_checksums(const std::filesystem::path& a, const std::filesystem::path& b) {
  return std::system(("h5diff " + a.string() + " " + b.string() +
                      " /_shardckpt/checksums /_shardckpt/checksums > /dev/null")
                         .c_str()) == 0;
}

}  // namespace testing_support
