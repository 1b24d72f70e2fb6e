// Tests for the storage module's format partition (shardckpt.storage:format): a reader that refuses
// damaged or hostile files (incomplete, truncated, with damaged metadata, hostile attributes or
// slab tables, virtual datasets, changed under it) with a typed error instead of crashing, and
// replays every input of the fuzzer.
#include "support.hpp"

TEST(Format, FilesThatAreNotCompleteCheckpointsAreRefused) {
  ScratchDir dir;
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "missing.h5"); }).code(), Errc::not_a_checkpoint);
  std::ofstream(dir / "text.h5") << "not hdf5 at all";
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "text.h5"); }).code(), Errc::not_a_checkpoint);
  // A skeleton that was never marked complete: a save that died half-way.
  (void)skeleton_at(dir / "partial.h5", two_datasets(), two_checksums);
  const Error e = error_of([&] { CheckpointReader r(dir / "partial.h5"); });
  EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
  EXPECT_TRUE(contains(e.what(), "did not finish")) << e.what();
  if (have_python_module("h5py")) {
    ASSERT_EQ(run_python("import h5py, sys\nh5py.File(sys.argv[1], 'w')['x'] = [1, 2]\n", (dir / "foreign.h5").string()),
              0);
    EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "foreign.h5"); }).code(), Errc::not_a_checkpoint);
  }
}

TEST(Format, TruncatedFileIsRefused) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  // Past the seal's trailer and into what HDF5 wrote.
  std::filesystem::resize_file(dir / "c.h5", std::filesystem::file_size(dir / "c.h5") - 4096);
  EXPECT_EQ(error_of([&] {
              const CheckpointReader r(dir / "c.h5");
              (void)read_out(r);
            }).code(),
            Errc::not_a_checkpoint);
}

TEST(Format, TheSealCatchesDamagedMetadataBeforeHdf5ReadsIt) {
  ScratchDir dir;
  const auto file = dir / "c.h5";
  write_all(file, IoMethod::raw);
  const std::optional<std::uint64_t> seal = CheckpointReader(file).seal();
  ASSERT_TRUE(seal.has_value());
  const std::string good = testing_support::file_bytes(file);
  const auto damaged = [&](std::uint64_t at) {
    std::ofstream(file, std::ios::binary) << good;
    flip_byte(file, at);
    return error_of([&] { CheckpointReader r(file); });
  };
  // The superblock, the root group's header, the seal's own trailer: each is refused as damaged,
  // naming the file, before HDF5 parses a byte.
  for (const std::uint64_t at : {std::uint64_t{8}, std::uint64_t{60}, good.size() - 30, good.size() - 60}) {
    const Error e = damaged(at);
    EXPECT_EQ(e.code(), Errc::corrupt) << "byte " << at << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), file.string())) << e.what();
  }
  // A rank that is told which seal another rank checked opens only that checkpoint.
  std::ofstream(file, std::ios::binary) << good;
  EXPECT_NO_THROW(CheckpointReader(file, {.trusted_seal = *seal}));
  EXPECT_EQ(error_of([&] { CheckpointReader r(file, {.trusted_seal = *seal + 1}); }).code(), Errc::replaced);
  EXPECT_EQ(error_of([&] { CheckpointReader r(file, {.trusted_seal = 0}); }).code(), Errc::replaced);
  // Without its trailer the file is read as an unsealed one (as after h5py changed it).
  std::filesystem::resize_file(file, good.size() - 48);
  EXPECT_FALSE(CheckpointReader(file).seal().has_value());
  const auto v = read_out(CheckpointReader(file));
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], out_value(i)) << i;
}

TEST(Format, ReadsWhatH5pyAddsAndRefusesWhatIsNotOurs) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  const auto py = [&](const std::string& code) {
    return run_python("import h5py, numpy as np, sys\nf = h5py.File(sys.argv[1], 'r+')\n" + code + "\n",
                      (dir / "c.h5").string());
  };
  // A variable-length string common value (h5py's default), a group and a dataset without a value
  // (h5py.Empty) of someone else's: read, skipped and named. A scalar dataset is a tensor (global
  // shape []), whose bytes a checksummed checkpoint cannot check when it has no slab table.
  ASSERT_EQ(py("f['_shardckpt/common'].attrs['note'] = 'from h5py'\nf.create_group('extra')\nf['scalar'] = 3\n"
               "f.create_dataset('empty', data=h5py.Empty('f'))"),
            0);
  {
    const CheckpointReader r(dir / "c.h5");
    EXPECT_EQ(std::get<std::string>(r.contents().common.at("note")), "from h5py");
    EXPECT_EQ(r.datasets().size(), 3u);
    EXPECT_TRUE(r.dataset("scalar").shape.empty());
    ASSERT_EQ(r.skipped().size(), 2u);
    EXPECT_EQ(r.skipped()[0].first, "empty");
    const Error e = error_of([&] { (void)r.dataset("empty"); });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
    EXPECT_TRUE(contains(e.what(), "null dataspace")) << e.what();
    const Error unchecked = error_of([&] { (void)r.slabs(r.dataset("scalar")); });
    EXPECT_EQ(unchecked.code(), Errc::not_a_checkpoint);
    EXPECT_TRUE(contains(unchecked.what(), "dataset scalar has no slab table")) << unchecked.what();
  }
  ASSERT_EQ(py("f['_shardckpt'].attrs['format'] = 'other'"), 0);
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "c.h5"); }).code(), Errc::not_a_checkpoint);
  ASSERT_EQ(py("del f['_shardckpt'].attrs['format']"), 0);
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "c.h5"); }).code(), Errc::not_a_checkpoint);
}

// Each damage is refused with Errc::not_a_checkpoint naming what is wrong; none may crash (the
// ASan+UBSan build runs this suite too: reading an attribute of any shape into a fixed buffer was
// a stack or heap overflow).
TEST(Format, HostileAttributesAreRefusedByName) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  struct Case {
    const char* code;
    const char* names;
  };
  const Case cases[] = {
      {"m.attrs['format_version'] = np.arange(8, dtype=np.int64)", "format_version"},
      {"m.attrs['format_version'] = np.arange(100000, dtype=np.int64)", "format_version"},
      {"m.attrs['format_version'] = np.int64(3)", "format version 3"},
      {"m.attrs['format_version'] = np.float64(2)", "format_version"},
      {"m.attrs['params'] = np.array([b'a', b'b', b'c', b'd'])", "params"},
      {"m.attrs['params'] = np.int64(4)", "params"},
      {"m.attrs['params'] = np.bytes_('[{\"key\": \"w\", \"tp_axis\": \"rows\", \"blocks\": [], \"trailing\": []}]')",
       "params"},
      {"m.attrs['params'] = np.bytes_('[{\"key\": \"w\", \"tp_axis\": \"rows\", \"blocks\": [{\"name\": \"\", \"rows\": "
       "1e300}], \"trailing\": [4]}]')",
       "params"},
      {"m.attrs['params'] = np.bytes_('[' * 100000)", "params"},
      {"m.attrs['params'] = np.bytes_('[{\"key\": \"w\", \"tp_axis\": \"rows\", \"blocks\": [{\"name\": \"\", \"rows\": "
       "8}], \"trailing\": [4], \"divisors\": [{\"name\": \"heads\", \"count\": -8}]}]')",
       "divisor heads must be positive"},
      {"m.attrs['params'] = np.bytes_('[{\"key\": \"w\", \"tp_axis\": \"rows\", \"blocks\": [{\"name\": \"\", \"rows\": "
       "8}], \"trailing\": [4], \"divisors\": {\"heads\": 8}}]')",
       "divisors must be an array"},
      {"m.attrs['complete'] = np.int64(0)", "complete"},
      {"m.attrs['complete'] = 'no'", "complete"},
      {"m.attrs['complete'] = np.ones(3, dtype=np.int64)", "complete"},
      {"del m.attrs['complete']", "did not finish"},
      {"m.attrs['kind'] = 'galactic'", "kind"},
      {"m.attrs['kind'] = np.array([b'global', b'local'])", "kind"},
      {"m.attrs['checkpoint_id'] = np.int64(5)", "checkpoint_id"},
      {"m.attrs['checksums'] = 'crc32'", "checksums"},
      {"f['_shardckpt/common'].attrs['iteration'] = np.array([1, 2], dtype=np.int64)", "iteration"},
      {"f['_shardckpt/common'].attrs['iteration'] = np.uint64(2**64 - 1)", "iteration"},
      {"f['_shardckpt/common'].attrs['iteration'] = np.array([(1, 2.0)], dtype=[('a', 'i8'), ('b', 'f8')])[0]",
       "iteration"},
      {"del f['_shardckpt/slabs']", "slabs"},
      {"del f['_shardckpt/checksums']", "checksums"},
      {"del f['_shardckpt/checksums']\nf['_shardckpt/checksums'] = np.zeros((2, 8), dtype=np.uint64)", "checksums"},
      // Dims whose element count overflows 64 bits (HDF5 allocates nothing for unwritten chunks).
      {"f.create_dataset('huge', shape=(2**62, 2**10), chunks=(1, 1), dtype='f4')", "huge"},
  };
  for (const Case& c : cases) {
    const auto file = dir / "h.h5";
    std::filesystem::remove(file);
    write_all(file, IoMethod::raw);
    ASSERT_EQ(run_python(std::string("import h5py, numpy as np, sys\nf = h5py.File(sys.argv[1], 'r+')\n"
                                     "m = f['_shardckpt']\n") +
                             c.code + "\n",
                         file.string()),
              0)
        << c.code;
    const Error e = error_of([&] {
      const CheckpointReader r(file);
      (void)read_out(r);
      (void)r.datasets();
    });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint) << c.code << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), c.names)) << c.code << ": " << e.what();
  }
}

TEST(Format, HostileSlabTablesAreRefused) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  const char* cases[] = {
      "t[1, 0] = 1",               // slabs overlap
      "t[0, 1] = 1",               // a gap
      "t[1, 4] = 2**40",           // first unit past the table
      "t[0, 3] = 5",               // columns past the row
      "t[0, 0] = -1",              // before the first row
  };
  for (const char* code : cases) {
    const auto file = dir / "s.h5";
    std::filesystem::remove(file);
    write_all(file, IoMethod::raw);
    ASSERT_EQ(run_python(std::string("import h5py, numpy as np, sys\nf = h5py.File(sys.argv[1], 'r+')\n"
                                     "a = f['_shardckpt/slabs'].attrs\nt = a['w.z'].copy()\n") +
                             code + "\na['w.z'] = t\n",
                         file.string()),
              0);
    const Error e = error_of([&] {
      const CheckpointReader r(file);
      HostBuffer b = HostBuffer::zeros(DType::bf16, {6, 4});
      r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4}, b.mut_view());
    });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint) << code << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), "w.z")) << e.what();
  }
}

// Every seed of the fuzzer and every input it ever found crashing the reader: none may crash now.
TEST(Format, TheFuzzersInputsAreRefusedOrReadWithoutCrashing) {
  int replayed = 0;
  for (const char* sub : {"corpus", "regressions"})
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(SHARDCKPT_FUZZ_DIR) / sub)) {
      const std::string bytes = testing_support::file_bytes(e.path());
      testing_support::fuzz_one_input(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  EXPECT_GT(replayed, 0);
}

// What a reader checked when it opened the file is what HDF5 reads later: a file changed in place
// (not replaced) under an open reader is an error, never bytes HDF5 parses unchecked.
TEST(Format, AFileChangedInPlaceUnderAReaderIsAnErrorNeverACrash) {
  ScratchDir dir;
  const auto file = dir / "c.h5";
  write_all(file, IoMethod::raw);
  const std::string good = testing_support::file_bytes(file);
  const std::uint64_t digest = *CheckpointReader(file).seal();
  // The datasets' headers are read on first use: after the open, scribble over every byte between the
  // superblock and the seal's trailer (in place: the reader's descriptor sees the new bytes).
  const auto scribbled = [&](std::optional<std::uint64_t> trusted) {
    std::ofstream(file, std::ios::binary) << good;
    const CheckpointReader r(file, {.trusted_seal = trusted});
    {
      std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
      f.seekp(512);
      f << std::string(good.size() - 512 - 2048, '\xAB');
    }
    return error_of([&] {
      const Dataset& d = r.dataset("w.out");
      (void)read_out(r);
      (void)d;
    });
  };
  for (const std::optional<std::uint64_t> trusted : {std::optional<std::uint64_t>{}, std::optional(digest)}) {
    const Error e = scribbled(trusted);
    EXPECT_EQ(e.code(), Errc::corrupt) << e.what();
    EXPECT_TRUE(contains(e.what(), "changed after it was sealed")) << e.what();
  }
  // Truncated in place under the reader: the same.
  std::ofstream(file, std::ios::binary) << good;
  const CheckpointReader r(file);
  std::filesystem::resize_file(file, 1024);
  EXPECT_EQ(error_of([&] { (void)read_out(r); }).code(), Errc::corrupt);
}

// Virtual datasets read as fill values where their sources are missing, and as another file's bytes
// where they are not: never read.
TEST(Format, VirtualDatasetsAreRefused) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  ASSERT_EQ(run_python(std::string(R"(
import h5py, numpy as np, sys, os
d = os.path.dirname(sys.argv[1])
with h5py.File(os.path.join(d, "source.h5"), "w") as s:
    s["x"] = np.arange(8, dtype=np.float32).reshape(4, 2)
layout = h5py.VirtualLayout(shape=(4, 2), dtype=np.float32)
layout[...] = h5py.VirtualSource(os.path.join(d, "source.h5"), "x", shape=(4, 2))
with h5py.File(sys.argv[1], "w") as f:
    f.create_virtual_dataset("w", layout, fillvalue=-1)
)") + version1_metadata,
                       (dir / "virtual.h5").string()),
            0);
  const CheckpointReader r(dir / "virtual.h5");
  const Error e = error_of([&] { (void)r.dataset("w"); });
  EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
  EXPECT_TRUE(contains(e.what(), "virtual dataset")) << e.what();
}
