// Tests for the storage module's format partition (shardckpt.storage:format): both write paths,
// contiguous or chunked; reads of any box, each checked against its checksums; metadata; files
// without checksums; atomic commit; HDF5 errors by name.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>

#include "support.hpp"

TEST(Format, BothWritePathsProduceIdenticalTensorsContiguousOrChunked) {
  ScratchDir dir;
  for (bool chunked : {false, true}) {
    const auto raw = dir / (chunked ? "raw-c.h5" : "raw.h5"),
               hyper = dir / (chunked ? "hyper-c.h5" : "hyper.h5");
    write_all(raw, IoMethod::raw, chunked);
    write_all(hyper, IoMethod::hyperslab, chunked);
    const CheckpointReader a(raw), b(hyper);
    for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
      const auto va = read_out(a, {m}), vb = read_out(b, {m});
      EXPECT_EQ(va, vb);
      for (std::size_t i = 0; i < va.size(); ++i) ASSERT_EQ(va[i], out_value(i)) << i;
    }
    // Same tensors, same checksums: h5diff compares every element and the checksum table.
    EXPECT_TRUE(testing_support::same_tensors(raw, hyper));
    EXPECT_TRUE(testing_support::same_checksums(raw, hyper));
  }
  EXPECT_TRUE(testing_support::same_tensors(dir / "raw.h5", dir / "raw-c.h5"));
}

TEST(Format, ChunkedBandsReadAtAnyWidthAndEveryReadIsChecked) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw, true);
  const CheckpointReader r(dir / "c.h5");
  const Dataset& d = r.dataset("w.out");
  // Rows 1..4 of dim-1 columns [1, 3): across both bands, both row chunks, and half of each saved
  // unit (those are read whole, checked, and their asked-for part copied).
  for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
    HostBuffer b = HostBuffer::zeros(DType::f32, {3, 2, 2});
    r.read(d, std::vector<std::int64_t>{1, 1, 0}, std::vector<std::int64_t>{3, 2, 2}, b.mut_view(), {m});
    const auto v = b.view().as<float>();
    for (int row = 0; row < 3; ++row)
      for (int e = 0; e < 4; ++e)
        EXPECT_EQ(v[static_cast<std::size_t>(row * 4 + e)], out_value(static_cast<std::size_t>((row + 1) * 8 + 2 + e)))
            << row << " " << e;
  }
}

TEST(Format, DatasetsHaveGlobalShapesAndTheMetadataIsComplete) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  const CheckpointReader r(dir / "c.h5");
  ASSERT_EQ(r.datasets().size(), 2u);
  EXPECT_EQ(r.version(), format_version);
  EXPECT_TRUE(r.checksummed());
  EXPECT_EQ(r.contents().id, std::string(32, 'a'));
  const Dataset& z = r.dataset("w.z");
  EXPECT_EQ(z.dtype, DType::bf16);
  EXPECT_EQ(z.shape, (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(std::get<std::int64_t>(r.contents().common.at("iteration")), 7);
  HostBuffer rows = HostBuffer::zeros(DType::bf16, {3, 4});
  r.read(z, std::vector<std::int64_t>{1, 0}, std::vector<std::int64_t>{3, 4}, rows.mut_view());
  EXPECT_EQ(to_f32(rows.view().as<bf16>()[0]), 4.5f);  // element (1, 0) = 4 + 0.5
  ASSERT_EQ(r.slabs(z).size(), 2u);
  EXPECT_EQ(r.slabs(z)[1].box.rows, (Range{2, 6}));
  EXPECT_EQ(r.slabs(z)[1].first_checksum, 2);
}

TEST(Format, H5pyReadsTheTensorsAndRecomputesEveryChecksum) {
  if (!have_python_module("h5py") || !have_python_module("xxhash")) GTEST_SKIP() << "h5py or xxhash is missing";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  // What docs/format.md says a checksum is, checked by another implementation: XXH3-64 of the
  // stored bytes of each row of each slab, at first_checksum + (row - first row) in the table.
  EXPECT_EQ(run_python(R"(
import h5py, numpy as np, sys, xxhash
path = sys.argv[1]
f = h5py.File(path, "r")
assert f["w.z"].dtype.name == "float32" and f["w.z"][1, 0] == 4.5 and f["w.z"][5, 3] == 23.5
sums = f["_shardckpt/checksums"][()]
raw = open(path, "rb").read()
checked = 0
for key, table in f["_shardckpt/slabs"].attrs.items():
    d = f[key]
    size = 2 if key == "w.z" else 4
    row = int(np.prod(d.shape[1:])) * size
    base = d.id.get_offset()
    for r0, r1, c0, c1, first in table:
        for r in range(r0, r1):
            b = raw[base + r * row + c0 * size: base + r * row + c1 * size]
            assert xxhash.xxh3_64_intdigest(b) == int(sums[first + r - r0]), (key, r)
            checked += 1
assert checked == 16, checked
)",
                       (dir / "c.h5").string()),
            0);
}

// Rows long enough for XXH3's vectorized path (past 240 bytes), which the library runs with AVX2
// where the CPU has it: the same checksums as another implementation computes.
TEST(Format, ChecksumsOfLongRowsAreXxh3OfTheirBytesWhateverTheVectorWidth) {
  if (!have_python_module("h5py") || !have_python_module("xxhash")) GTEST_SKIP() << "h5py or xxhash is missing";
  ScratchDir dir;
  StateDict s;
  std::vector<SharedBuffer> kept;
  for (const std::int64_t cols : {61, 1001, 4096}) {
    SharedBuffer b = SharedBuffer::uninitialized(DType::f32, {8, cols});
    float x = 0.25f * static_cast<float>(cols);
    for (float& v : b.mut_view().as<float>()) v = (x += 1.5f);
    s.add(ShardedTensor::of(cat("t", cols), b, {8, cols}, {0, 0}));
    kept.push_back(std::move(b));
  }
  save(s, dir / "l.h5");
  EXPECT_EQ(run_python(R"(
import h5py, sys, xxhash
path = sys.argv[1]
f = h5py.File(path, "r")
sums = f["_shardckpt/checksums"][()]
raw = open(path, "rb").read()
checked = 0
for key, table in f["_shardckpt/slabs"].attrs.items():
    d = f[key]
    row = d.shape[1] * 4
    base = d.id.get_offset()
    for r0, r1, c0, c1, first in table:
        for r in range(r0, r1):
            assert xxhash.xxh3_64_intdigest(raw[base + r * row + c0 * 4: base + r * row + c1 * 4]) == int(sums[first + r - r0]), (key, r)
            checked += 1
assert checked == 24, checked
)",
                       (dir / "l.h5").string()),
            0);
}

TEST(Format, AFlippedDataByteIsCorruptNamingTheFileKeyAndRows) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
    const auto file = dir / (m == IoMethod::raw ? "d.h5" : "h.h5");
    write_all(file, IoMethod::raw);
    // Element (3, 1) of w.z: in the second slab, row 3.
    flip_byte(file, data_address(file, "w.z") + (3 * 4 + 1) * 2);
    const CheckpointReader r(file);
    HostBuffer all = HostBuffer::zeros(DType::bf16, {6, 4});
    const Error e = error_of([&] {
      r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4}, all.mut_view(), {m});
    });
    EXPECT_EQ(e.code(), Errc::corrupt);
    EXPECT_TRUE(contains(e.what(), file.string()) && contains(e.what(), "key w.z") && contains(e.what(), "rows [3, 4)"))
        << e.what();
    // Rows that do not hold the flipped byte read cleanly; unchecked, the bad row reads too.
    HostBuffer two = HostBuffer::zeros(DType::bf16, {2, 4});
    EXPECT_NO_THROW(r.read(r.dataset("w.z"), std::vector<std::int64_t>{4, 0}, std::vector<std::int64_t>{2, 4},
                           two.mut_view(), {m}));
    EXPECT_NO_THROW(r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4},
                           all.mut_view(), {m, false}));
    const VerifyReport v = verify_checkpoint(r);
    EXPECT_EQ(v.mismatches, 1);
    EXPECT_EQ(v.checksum_rows, two_checksums);
    ASSERT_EQ(v.problems.size(), 1u);
    EXPECT_TRUE(contains(v.problems[0], "rows [3, 4)")) << v.problems[0];
  }
}

TEST(Format, AFlippedByteInAPartOfAUnitOutsideTheReadIsStillFound) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  // w.out row 2, flat element 1 (left band, dim-1 column 0): a read of dim-1 column 1 only still
  // reads the whole left-band unit of row 2 to check it.
  flip_byte(dir / "c.h5", data_address(dir / "c.h5", "w.out") + (2 * 8 + 1) * 4);
  const CheckpointReader r(dir / "c.h5");
  HostBuffer b = HostBuffer::zeros(DType::f32, {1, 1, 2});
  EXPECT_EQ(error_of([&] {
              r.read(r.dataset("w.out"), std::vector<std::int64_t>{2, 1, 0}, std::vector<std::int64_t>{1, 1, 2},
                     b.mut_view());
            }).code(),
            Errc::corrupt);
  EXPECT_NO_THROW(r.read(r.dataset("w.out"), std::vector<std::int64_t>{2, 2, 0}, std::vector<std::int64_t>{1, 1, 2},
                         b.mut_view()));
}

TEST(Format, ReadsRejectAWrongDtypeOrSlab) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  const CheckpointReader r(dir / "c.h5");
  HostBuffer f = HostBuffer::zeros(DType::f32, {6, 4});
  EXPECT_EQ(error_of([&] {
              r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4}, f.mut_view());
            }).code(),
            Errc::dtype_mismatch);
  HostBuffer b = HostBuffer::zeros(DType::bf16, {2, 4});
  EXPECT_EQ(error_of([&] {
              r.read(r.dataset("w.z"), std::vector<std::int64_t>{5, 0}, std::vector<std::int64_t>{2, 4}, b.mut_view());
            }).code(),
            Errc::invalid_argument);
  EXPECT_EQ(error_of([&] { (void)r.dataset("w.q"); }).code(), Errc::missing_key);
}

TEST(Format, CommitReplacesAtomicallyAndDiscardCleansUp) {
  ScratchDir dir;
  const auto final_path = dir / "ckpt.h5";
  {
    io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(final_path));
    write_into(temp.file(), IoMethod::raw);
    EXPECT_FALSE(std::filesystem::exists(final_path));
    temp.commit();
  }
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  EXPECT_NO_THROW(CheckpointReader r(final_path));
  const std::string before = testing_support::file_bytes(final_path);
  {
    io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(final_path));
    (void)create_skeleton(temp.file(), two_datasets(), {}, two_checksums);
    EXPECT_EQ(testing_support::temporary_files(dir.path()).size(), 1u);
    temp.discard();
    EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  }
  {
    io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(final_path));
  }  // never committed: removed
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  EXPECT_EQ(testing_support::file_bytes(final_path), before);
}

TEST(Format, ACheckpointWriterTakesItsStepsOnceAndInOrderAndADroppedStepLeavesNothing) {
  ScratchDir dir;
  const auto path = dir / "ckpt.h5";
  const auto create = [&] {
    return CheckpointWriter::create(io::Destination::of(path), two_datasets(),
                                    {CheckpointKind::global, {}, {}, std::string(32, 'a')}, two_checksums);
  };
  // Dropped at each step before its commit: the temporary file goes, nothing is at the path.
  { CheckpointWriter w = create(); EXPECT_EQ(testing_support::temporary_files(dir.path()).size(), 1u); }
  {
    CheckpointWriter w = create();
    PiecesWritten done = w.pieces(IoMethod::raw, 0).finish();
    WrittenCheckpoint written = std::move(w).written(std::move(done));
  }
  {
    CheckpointWriter w = create();
    PieceWriter pieces = w.pieces(IoMethod::raw, 0);
    SealedCheckpoint sealed = std::move(w).written(pieces.finish()).seal();
  }
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  EXPECT_FALSE(std::filesystem::exists(path));
  // Proof of pieces written to another file is refused; a step on a step already taken (where
  // -Wconsumed cannot see it, through an optional) is an error, not a second commit.
  {
    CheckpointWriter w = create(), other = create();
    PiecesWritten elsewhere = other.pieces(IoMethod::raw, 0).finish();
    const Error e = error_of([&] { (void)std::move(w).written(std::move(elsewhere)); });
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_TRUE(contains(e.what(), "of another file")) << e.what();
  }
  std::optional<SealedCheckpoint> sealed;
  {
    CheckpointWriter w = create();
    PieceWriter pieces = w.pieces(IoMethod::raw, 0);
    sealed.emplace(std::move(w).written(pieces.finish()).seal());
  }
  std::move(*sealed).commit();
  EXPECT_TRUE(std::filesystem::exists(path));
  const Error twice = error_of([&] { std::move(*sealed).commit(); });
  EXPECT_EQ(twice.code(), Errc::invalid_argument);
  EXPECT_TRUE(contains(twice.what(), "moved on (commit)")) << twice.what();
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  EXPECT_NO_THROW(CheckpointReader r(path));
}

TEST(Format, AReaderKeepsReadingTheFileItOpenedWhenThePathIsReplaced) {
  ScratchDir dir;
  write_all(dir / "a.h5", IoMethod::raw, false, {{"tag", std::string("old")}});
  const CheckpointReader r(dir / "a.h5");
  write_all(dir / "b.h5", IoMethod::raw, false, {{"tag", std::string("new")}});
  std::filesystem::resize_file(dir / "b.h5", 4096);  // what the new file holds does not matter to r
  std::filesystem::rename(dir / "b.h5", dir / "a.h5");
  EXPECT_EQ(std::get<std::string>(r.contents().common.at("tag")), "old");
  const auto v = read_out(r);
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], out_value(i)) << i;
  EXPECT_NE(r.identity(), io::File::open_read(dir / "a.h5").identity());
}

namespace {

// A thread blocked in open(FIFO, O_WRONLY), as a program writing into a FIFO waits for a reader: any
// open of the FIFO for reading (or for reading and writing), even one closed at once, releases it.
class BlockedWriter {
 public:
  explicit BlockedWriter(const std::filesystem::path& fifo) : fifo_(fifo) {
    thread_ = std::thread([this] {
      tid_ = ::gettid();
      const int fd = ::open(fifo_.c_str(), O_WRONLY | O_CLOEXEC);
      released_ = true;
      if (fd >= 0) ::close(fd);
    });
    // Until it is inside openat (257 on x86-64): a reader that came first would release nothing.
    for (int i = 0; i < 1000; ++i) {
      std::string call;
      if (tid_ != 0) std::ifstream(cat("/proc/self/task/", tid_.load(), "/syscall")) >> call;
      if (call == "257" || call == "2") break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  // Whether something opened the FIFO for reading (given the writer a moment to return).
  bool released() const {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return released_;
  }
  ~BlockedWriter() {
    const int reader = ::open(fifo_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // lets the writer go
    thread_.join();
    if (reader >= 0) ::close(reader);
  }

 private:
  std::filesystem::path fifo_;
  std::atomic<pid_t> tid_{0};
  std::atomic<bool> released_{false};
  std::thread thread_;
};

}  // namespace

// A FIFO where the storage layer expects a regular file (a file beside a checkpoint, another rank's
// temporary file) is looked at and refused, never opened: opening it, even without blocking, would
// release a writer waiting on it.
TEST(Format, AFifoWhereAFileIsExpectedIsRefusedWithoutBeingOpened) {
  ScratchDir dir;
  const std::string name = io::temporary_name_for("ckpt.h5");
  ASSERT_EQ(0, ::mkfifo((dir / name).c_str(), 0600));
  {
    const BlockedWriter w(dir / name);
    const Error e = error_of([&] { (void)io::Directory::open(dir.path()).open_regular(name, Errc::not_a_checkpoint); });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
    EXPECT_TRUE(contains(e.what(), "is a FIFO, not a regular file")) << e.what();
    EXPECT_FALSE(w.released()) << "open_regular opened the FIFO";
  }
  {
    const BlockedWriter w(dir / name);
    const Error e = error_of([&] { (void)io::TemporaryFile::open_created(dir.path(), name, io::SharedIdentity{}); });
    EXPECT_EQ(e.code(), Errc::io);
    EXPECT_TRUE(contains(e.what(), "is a FIFO, not the file this save created")) << e.what();
    EXPECT_FALSE(w.released()) << "open_created opened the FIFO";
  }
}

// Reads around the page cache open the reader's own file again, never its path, where a FIFO may
// stand by now.
TEST(Format, ReadsAroundThePageCacheNeverOpenWhatThePathNamesNow) {
  ScratchDir dir;
  write_all(dir / "a.h5", IoMethod::raw);
  const CheckpointReader r(dir / "a.h5");
  ASSERT_EQ(0, ::mkfifo((dir / "fifo").c_str(), 0600));
  std::filesystem::rename(dir / "a.h5", dir / "kept.h5");
  std::filesystem::rename(dir / "fifo", dir / "a.h5");
  const BlockedWriter w(dir / "a.h5");
  const auto v = read_out(r, {.bypass_page_cache = true});
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], out_value(i)) << i;
  EXPECT_FALSE(w.released()) << "a read around the page cache opened the FIFO at the checkpoint's path";
}

TEST(Format, Hdf5ErrorsNameTheFileAndKey) {
  ScratchDir dir;
  const std::vector<Dataset> dup{{"k", DType::f32, {2}, std::nullopt, {}, {}},
                                     {"k", DType::f32, {2}, std::nullopt, {}, {}}};
  const Error e = error_of([&] { (void)skeleton_at(dir / "d.h5", dup, 0); });
  EXPECT_EQ(e.code(), Errc::hdf5);
  EXPECT_TRUE(contains(e.what(), "of key k in ") && contains(e.what(), "d.h5")) << e.what();
  EXPECT_EQ(error_of([&] {
              (void)skeleton_at(dir / "bad.h5", std::vector<Dataset>{{"a/b", DType::f32, {2}, std::nullopt, {}, {}}},
                                0);
            }).code(),
            Errc::invalid_argument);
}

TEST(Format, CheckpointsWithoutChecksumsStillLoad) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  // A version 1 checkpoint, as shardckpt wrote them before checksums existed (and as docs/format.md
  // shows for adopting a file written by another tool).
  ASSERT_EQ(run_python(std::string(R"(
import h5py, numpy as np, sys
with h5py.File(sys.argv[1], "w") as f:
    f["w.out"] = (np.arange(40, dtype=np.float32) * 3).reshape(5, 4, 2)
)") + version1_metadata,
                       (dir / "v1.h5").string()),
            0);
  const CheckpointReader r(dir / "v1.h5");
  EXPECT_EQ(r.version(), 1);
  EXPECT_FALSE(r.checksummed());
  EXPECT_TRUE(r.contents().id.empty());
  const auto v = read_out(r);
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], out_value(i)) << i;
  const VerifyReport report = verify_checkpoint(r);
  EXPECT_FALSE(report.checksummed);
  EXPECT_EQ(report.checksum_rows, 0);
}

TEST(Format, ManyChunksAreReadInLinearTime) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  // 20,000 chunks of one row each: looking up every chunk's address made this quadratic (11 s for
  // 32,768 to inspect, minutes to load); such a dataset is read through HDF5.
  ASSERT_EQ(run_python(std::string(R"(
import h5py, numpy as np, sys
with h5py.File(sys.argv[1], "w") as f:
    d = f.create_dataset("w", shape=(20000, 4), dtype=np.float32, chunks=(1, 4))
    d[...] = np.arange(80000, dtype=np.float32).reshape(20000, 4)
)") + version1_metadata,
                       (dir / "chunks.h5").string()),
            0);
  const CheckpointReader r(dir / "chunks.h5");
  HostBuffer b = HostBuffer::zeros(DType::f32, {20000, 4});
  r.read(r.dataset("w"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{20000, 4}, b.mut_view());
  const auto v = b.view().as<float>();
  for (std::size_t i = 0; i < v.size(); i += 997) ASSERT_EQ(v[i], static_cast<float>(i));
}
