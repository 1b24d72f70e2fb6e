// Tests for the storage module's file partition (shardckpt.storage:file). Bulk reads: every range,
// alignment and row pattern reads the file's bytes whether it bypasses the page cache or not; the
// end of the file is the same error either way; a bypassing reader leaves the page cache empty; a
// replaced path is never read. Names nobody can plant: temporary files, their commit, destinations
// and directories held open.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "test_support.hpp"
#include "test_model.hpp"
import shardckpt;

using namespace shardckpt;
using testing_support::contains;
using testing_support::error_of;
using testing_support::cached_pages_after;
using testing_support::direct_io_possible;
using testing_support::ScratchDir;

namespace {

// Bytes no two offsets of which are likely equal, so that a read from the wrong place shows.
std::vector<std::byte> pattern(std::size_t n) {
  std::vector<std::byte> out(n);
  std::uint64_t x = 0x9e3779b97f4a7c15;
  for (auto& b : out) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  return out;
}

std::filesystem::path write_file(const std::filesystem::path& p, const std::vector<std::byte>& bytes) {
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return p;
}

// Memory aligned to a page, `shift` bytes in: to put a destination at any alignment.
struct Destination {
  explicit Destination(std::size_t n, std::size_t shift)
      : base(static_cast<std::byte*>(std::aligned_alloc(4096, (n + shift + 4095) / 4096 * 4096 + 4096))),
        at(base + shift) {}
  Destination(const Destination&) = delete;
  Destination& operator=(const Destination&) = delete;
  ~Destination() { std::free(base); }
  std::byte* base;
  std::byte* at;
};

constexpr io::PageCache both[] = {io::PageCache::bypass, io::PageCache::use};
const char* name(io::PageCache c) { return c == io::PageCache::bypass ? "bypass" : "use"; }

constexpr std::size_t mib = std::size_t{1} << 20;
const std::size_t file_size = 3 * mib + 12345;  // not a multiple of 4096: the end is unaligned

}  // namespace

TEST(BulkReader, ReadsEveryRangeAtEveryAlignment) {
  ScratchDir dir;
  const std::vector<std::byte> bytes = pattern(file_size);
  const io::File file = io::File::open_read(write_file(dir / "f", bytes));
  struct Case {
    std::uint64_t offset;
    std::size_t n, shift;
  };
  const Case cases[] = {
      {0, 4096, 0},                                   // aligned on both sides: straight in
      {8192, 2 * mib + 4096, 0},                      // more than one bounce buffer's worth, straight in
      {7, 100, 0},                                    // inside one block
      {4095, 2, 3},                                   // across a block boundary
      {4096 + 7, 3 * 4096, 7},                        // offset and memory congruent: head, middle, tail
      {4096 + 7, 3 * 4096, 0},                        // not congruent: all through the bounce buffer
      {100, 2 * mib + 12345, 100},                    // congruent, several bounce buffers for nothing
      {123, 2 * mib + 999, 5},                        // not congruent, across several bounce buffers
      {file_size - 5000, 5000, 0},                    // up to the unaligned end of the file
      {file_size - 4096 - 17, 4096 + 17, 4096 - 17},  // the same, congruent
      {0, file_size, 0},                              // everything
  };
  for (io::PageCache cache : both) {
    const io::BulkReader reader(file, cache);
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message() << name(cache) << " offset " << c.offset << " n " << c.n << " shift " << c.shift);
      Destination d(c.n, c.shift);
      reader.read(d.at, c.n, c.offset);
      EXPECT_EQ(0, std::memcmp(d.at, bytes.data() + c.offset, c.n));
    }
  }
}

TEST(BulkReader, ScattersRowsThatFollowEachOtherInTheFile) {
  ScratchDir dir;
  const std::vector<std::byte> bytes = pattern(file_size);
  const io::File file = io::File::open_read(write_file(dir / "f", bytes));
  struct Case {
    std::uint64_t offset;
    std::size_t run, stride, count;
  };
  const Case cases[] = {
      {0, 4096, 8192, 300},                   // a column band of rows: aligned rows
      {13, 100, 300, 25000},                  // small unaligned rows across several bounce buffers
      {5, 700 * 1024, 800 * 1024, 3},         // rows larger than half a bounce buffer: one by one
      {file_size - 10 * 333, 333, 1000, 10},  // rows up to the end of the file
  };
  for (io::PageCache cache : both) {
    const io::BulkReader reader(file, cache);
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message() << name(cache) << " offset " << c.offset << " run " << c.run);
      std::vector<std::byte> out(c.stride * c.count, std::byte{0x5a});
      reader.read_runs(out.data(), c.run, c.stride, c.count, c.offset);
      for (std::size_t r = 0; r < c.count; ++r) {
        ASSERT_EQ(0, std::memcmp(out.data() + r * c.stride, bytes.data() + c.offset + r * c.run, c.run)) << "row " << r;
        // The gap between rows is not touched.
        for (std::size_t i = c.run; i < c.stride; ++i) ASSERT_EQ(out[r * c.stride + i], std::byte{0x5a}) << "row " << r;
      }
    }
  }
}

TEST(BulkReader, ReadingPastTheEndIsTheTruncationErrorEitherWay) {
  ScratchDir dir;
  const std::vector<std::byte> bytes = pattern(file_size);
  const io::File file = io::File::open_read(write_file(dir / "f", bytes));
  for (io::PageCache cache : both) {
    SCOPED_TRACE(name(cache));
    const io::BulkReader reader(file, cache);
    std::vector<std::byte> out(3 * mib);
    for (const auto& [offset, n] : {std::pair<std::uint64_t, std::size_t>{file_size - 100, 101},
                                    {file_size - 2 * mib, 2 * mib + 4096},
                                    {file_size + 4096, 1}}) {
      const Error e = error_of([&] { reader.read(out.data(), n, offset); });
      EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
      EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
    }
    const Error e = error_of([&] { reader.read_runs(out.data(), 1000, 2000, 20, file_size - 19 * 1000); });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST(BulkReader, ABypassingReaderLeavesThePageCacheEmpty) {
  ScratchDir dir;
  const std::vector<std::byte> bytes = pattern(file_size);
  const std::filesystem::path p = write_file(dir / "f", bytes);
  if (!direct_io_possible(p)) GTEST_SKIP() << "this file system refuses O_DIRECT";
  const io::File file = io::File::open_read(p);
  // Pages of the file in the page cache, once it was dropped from it and read by `cache`.
  const auto cached_after_read = [&](io::PageCache cache) {
    return cached_pages_after(p, [&] {
      const io::BulkReader reader(file, cache);
      EXPECT_EQ(reader.bypasses(), cache == io::PageCache::bypass);
      std::vector<std::byte> out(file_size);
      reader.read(out.data(), file_size, 0);
      EXPECT_EQ(out, bytes);
    });
  };
  EXPECT_EQ(cached_after_read(io::PageCache::bypass), 0u);
  // The control: the same read through the page cache leaves the pages there.
  EXPECT_EQ(cached_after_read(io::PageCache::use), (file_size + 4095) / 4096);
}

TEST(BulkReader, AReplacedPathIsNeverReadAroundTheCache) {
  ScratchDir dir;
  const std::vector<std::byte> first = pattern(file_size), second(file_size, std::byte{7});
  const io::File file = io::File::open_read(write_file(dir / "f", first));
  write_file(dir / "g", second);
  std::filesystem::rename(dir / "g", dir / "f");
  const io::BulkReader reader(file, io::PageCache::bypass);
  EXPECT_FALSE(reader.bypasses());
  std::vector<std::byte> out(file_size);
  reader.read(out.data(), file_size, 0);
  EXPECT_EQ(out, first);
}

// ---- names nobody can plant ---------------------------------------------------------------------

namespace {

std::uint32_t mode_of(const std::filesystem::path& p) {
  struct stat st{};
  EXPECT_EQ(0, ::lstat(p.c_str(), &st)) << p;
  return static_cast<std::uint32_t>(st.st_mode & 07777);
}

}  // namespace

TEST(TemporaryFile, IsCreatedUnderAFreshNameAndCommittedWithTheModeOfWhatItReplaces) {
  ScratchDir dir;
  const auto path = dir / "ckpt.h5";
  io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(path));
  EXPECT_TRUE(io::is_temporary_name(temp.name())) << temp.name();
  EXPECT_TRUE(temp.name().starts_with(".ckpt.h5.")) << temp.name();
  EXPECT_EQ(mode_of(dir / temp.name()), 0600u);  // nobody else reads it while it is written
  EXPECT_NE(io::temporary_name_for("ckpt.h5"), io::temporary_name_for("ckpt.h5"));
  temp.file().pwrite_all("new", 3, 0);
  EXPECT_FALSE(std::filesystem::exists(path));
  temp.commit();
  EXPECT_EQ(testing_support::file_bytes(path), "new");
  EXPECT_EQ(mode_of(path), io::new_file_mode());
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  // A replaced checkpoint's mode stays.
  ASSERT_EQ(0, ::chmod(path.c_str(), 0640));
  io::TemporaryFile again = io::TemporaryFile::create(io::Destination::of(path));
  again.commit();
  EXPECT_EQ(mode_of(path), 0640u);
}

TEST(TemporaryFile, ACommitChecksThatItsNameStillNamesTheFileItWrote) {
  ScratchDir dir;
  const auto path = dir / "ckpt.h5";
  std::ofstream(path) << "old";
  io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(path));
  temp.file().pwrite_all("mine", 4, 0);
  // Someone puts another file under the temporary file's name.
  std::ofstream(dir / "other") << "planted";
  std::filesystem::rename(dir / "other", dir / temp.name());
  const Error e = error_of([&] { temp.commit(); });
  EXPECT_EQ(e.code(), Errc::io);
  EXPECT_TRUE(contains(e.what(), "no longer the file this save wrote")) << e.what();
  EXPECT_EQ(testing_support::file_bytes(path), "old");
  // Discarding leaves the planted file alone: only the file this process created is removed.
  temp.discard();
  EXPECT_EQ(testing_support::file_bytes(dir / temp.name()), "planted");
}

TEST(TemporaryFile, OtherRanksOpenOnlyTheFileTheCreatorMade) {
  ScratchDir dir;
  io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(dir / "ckpt.h5"));
  EXPECT_NO_THROW((void)io::TemporaryFile::open_created(dir.path(), temp.name(), temp.identity()));
  // The same name, another file (the creator's file is still open, so the inode is not reused): refused.
  std::ofstream(dir / "other") << "planted";
  std::filesystem::rename(dir / "other", dir / temp.name());
  const Error e = error_of([&] { (void)io::TemporaryFile::open_created(dir.path(), temp.name(), temp.identity()); });
  EXPECT_EQ(e.code(), Errc::io);
  EXPECT_TRUE(contains(e.what(), "is not the temporary file rank 0 created")) << e.what();
  // A link at the name is not followed.
  std::filesystem::remove(dir / temp.name());
  std::filesystem::create_symlink(dir / "elsewhere", dir / temp.name());
  EXPECT_EQ(error_of([&] { (void)io::TemporaryFile::open_created(dir.path(), temp.name(), temp.identity()); }).code(),
            Errc::io);
  EXPECT_FALSE(std::filesystem::exists(dir / "elsewhere"));
}

TEST(Destination, RefusesAnythingButARegularFileAndFollowsLinksToOne) {
  ScratchDir dir;
  ASSERT_EQ(0, ::mkfifo((dir / "fifo").c_str(), 0600));
  std::filesystem::create_directory(dir / "d");
  std::filesystem::create_symlink(dir / "fifo", dir / "link-to-fifo");
  for (const char* name : {"fifo", "d", "link-to-fifo"}) {
    const Error e = error_of([&] { (void)io::Destination::of(dir / name); });
    EXPECT_EQ(e.code(), Errc::invalid_argument) << name;
    EXPECT_TRUE(contains(e.what(), "a save replaces only regular files")) << e.what();
  }
  std::ofstream(dir / "real.h5") << "x";
  std::filesystem::create_symlink(dir / "real.h5", dir / "link.h5");
  EXPECT_EQ(io::Destination::of(dir / "link.h5").name, "real.h5");
  EXPECT_EQ(io::Destination::of(dir / "new.h5").name, "new.h5");  // a new file is fine
}

TEST(Directory, OpensOnlyRegularFilesWithoutFollowingLinksOrBlocking) {
  ScratchDir dir;
  std::ofstream(dir / "plain") << "bytes";
  ASSERT_EQ(0, ::mkfifo((dir / "fifo").c_str(), 0600));
  std::filesystem::create_symlink(dir / "plain", dir / "link");
  std::filesystem::create_directory(dir / "d");
  const io::Directory d = io::Directory::open(dir.path());
  EXPECT_EQ(d.open_regular("plain", Errc::not_a_checkpoint).size(), 5u);
  // A FIFO would block a plain open forever; it is refused at once.
  for (const char* name : {"fifo", "link", "d", "../plain", "missing"})
    EXPECT_NE(error_of([&] { (void)d.open_regular(name, Errc::not_a_checkpoint); }).code(), Errc::internal) << name;
  EXPECT_EQ(error_of([&] { (void)d.open_regular("fifo", Errc::not_a_checkpoint); }).code(), Errc::not_a_checkpoint);
  EXPECT_EQ(error_of([&] { (void)d.open_regular("link", Errc::not_a_checkpoint); }).code(), Errc::not_a_checkpoint);
  EXPECT_EQ(error_of([&] { (void)d.open_regular("../plain", Errc::not_a_checkpoint); }).code(),
            Errc::not_a_checkpoint);
}

TEST(Descriptor, IsTheOneOwnerOfAnOpenDescriptor) {
  ScratchDir dir;
  const std::filesystem::path path = dir.path() / "f";
  std::ofstream(path) << "x";
  const auto is_open = [](int fd) { return ::fcntl(fd, F_GETFD) >= 0; };
  int fd = -1;
  {
    io::File a = io::File::open_read(path);
    fd = a.descriptor();
    io::File b = std::move(a);  // the descriptor moves; the moved-from file holds none
    EXPECT_FALSE(a.is_open());
    EXPECT_EQ(b.descriptor(), fd);
    EXPECT_EQ(b.path(), path);
    EXPECT_TRUE(is_open(fd));
    io::Directory d = io::Directory::open(dir.path());
    const int dfd = d.descriptor();
    io::Directory e = std::move(d);
    EXPECT_EQ(e.descriptor(), dfd);
    EXPECT_EQ(e.status().kind, io::FileKind::directory);
  }
  EXPECT_FALSE(is_open(fd));  // closed once, by its last owner
  io::File c = io::File::open_read(path);
  c.close();
  EXPECT_FALSE(c.is_open());
  EXPECT_NO_THROW(c.close());  // closing twice closes nothing (and no other file's descriptor)
}
