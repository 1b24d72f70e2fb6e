// Tests for loads into new memory over the checkpoint file (LoadOptions::map, CheckpointReader::map):
// what is mapped and what is not, that a mapped tensor is private (writes never reach the file) and
// outlives the reader and a save that replaces the file, and that every mapped row is checked.
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

// Whether this kernel has MADV_POPULATE_READ (Linux 5.14): asked of one page of anonymous memory.
bool populate_read_supported() {
  const long page = ::sysconf(_SC_PAGESIZE);
  void* p = ::mmap(nullptr, static_cast<std::size_t>(page), PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  const bool ok = ::madvise(p, static_cast<std::size_t>(page), MADV_POPULATE_READ) == 0;
  ::munmap(p, static_cast<std::size_t>(page));
  return ok;
}

// Whether [p, p + bytes) lies inside mappings of `file` in this process (/proc/self/maps), one
// mapping or several side by side (a tensor joined from runs of the file).
bool mapped_from(const void* p, std::size_t bytes, const std::filesystem::path& file) {
  std::ifstream maps("/proc/self/maps");
  const std::string name = std::filesystem::canonical(file).string();
  auto at = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t end = at + bytes;
  for (std::string line; std::getline(maps, line);) {  // in address order
    if (line.size() < name.size() || line.compare(line.size() - name.size(), name.size(), name) != 0) continue;
    std::uintptr_t begin = 0, stop = 0;
    char dash = 0;
    std::istringstream(line) >> std::hex >> begin >> dash >> stop;
    if (begin <= at && at < stop) at = stop;
    if (at >= end) return true;
  }
  return false;
}

// Where offset 0 of `file` lies in the mapping of it that holds `p` (0: no mapping of it does): two
// tensors with one base lie in one mapping of the file.
std::uintptr_t mapping_base(const void* p, const std::filesystem::path& file) {
  std::ifstream maps("/proc/self/maps");
  const std::string name = std::filesystem::canonical(file).string();
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    if (line.size() < name.size() || line.compare(line.size() - name.size(), name.size(), name) != 0) continue;
    std::uintptr_t begin = 0, stop = 0, offset = 0;
    char dash = 0;
    std::string perms;
    std::istringstream(line) >> std::hex >> begin >> dash >> stop >> perms >> offset;
    if (begin <= at && at < stop) return begin - offset;
  }
  return 0;
}

bool mapped_from(const SharedBuffer& b, const std::filesystem::path& file) {
  return mapped_from(b.view().data(), b.bytes(), file);
}

// Where the bytes of `v` first lie in a file's `bytes` (npos: nowhere).
std::size_t offset_of(const std::string& bytes, float v) {
  std::string pattern(sizeof v, '\0');
  std::memcpy(pattern.data(), &v, sizeof v);
  return bytes.find(pattern);
}

// A 256 x 64 f32 tensor "w" (64 KiB: its data aligned in the file) saved in two slabs of rows by
// two ranks, a small one "s" and a 3-D one "k" split past dim 1 (parts of rows).
constexpr std::int64_t rows = 256, cols = 64;

float value(std::int64_t r, std::int64_t c, float salt) { return static_cast<float>(r * cols + c) + salt; }

void save_tensors(const std::filesystem::path& path, float salt) {
  run_ranks(2, [&](ProcessGroup& g) {
    const std::int64_t half = rows / 2, first = g.rank() * half;
    SharedBuffer w = SharedBuffer::uninitialized(DType::f32, {half, cols});
    auto x = w.mut_view().as<float>();
    for (std::int64_t r = 0; r < half; ++r)
      for (std::int64_t c = 0; c < cols; ++c) x[static_cast<std::size_t>(r * cols + c)] = value(first + r, c, salt);
    SharedBuffer k = SharedBuffer::uninitialized(DType::f32, {4, 8, 4});
    for (float& v : k.mut_view().as<float>()) v = salt + static_cast<float>(g.rank());
    StateDict s;
    s.add(ShardedTensor::of("w", w, {rows, cols}, {first, 0}));
    s.add(ShardedTensor::of("k", k, {4, 8, 8}, {0, 0, 4 * g.rank()}));
    save(s, path, g);
  });
}

StateDict request_of(std::int64_t first, std::int64_t n) {
  StateDict r;
  r.add(ShardedTensor::expect("w", DType::f32, {n, cols}, {rows, cols}, {first, 0}));
  r.add(ShardedTensor::expect("k", DType::f32, {4, 8, 4}, {4, 8, 8}, {0, 0, 0}));
  return r;
}

void expect_rows(TensorView t, std::int64_t first, float salt) {
  const auto x = t.as<float>();
  for (std::int64_t r = 0; r < t.rows(); ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(x[static_cast<std::size_t>(r * cols + c)], value(first + r, c, salt)) << "row " << first + r;
}

// Saves one tensor "big" of n x width elements of T, element (r, c) at(r, c), from one rank; and
// the request for all of it.
template <class T, class At>
void save_big(const std::filesystem::path& path, std::int64_t n, std::int64_t width, At at) {
  SharedBuffer w = SharedBuffer::uninitialized(dtype_v<T>, {n, width});
  auto x = w.mut_view().as<T>();
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t c = 0; c < width; ++c) x[static_cast<std::size_t>(r * width + c)] = at(r, c);
  StateDict s;
  s.add(ShardedTensor::of("big", w, {n, width}, {0, 0}));
  run_ranks(1, [&](ProcessGroup& g) { save(s, path, g); });
}

StateDict big_request(DType dtype, std::int64_t n, std::int64_t width) {
  StateDict request;
  request.add(ShardedTensor::expect("big", dtype, {n, width}, {n, width}, {0, 0}));
  return request;
}

}  // namespace

// Whole rows of a contiguous dataset are a mapping of the file (across the slabs two ranks saved);
// parts of rows (a slab split past dim 1) are read into memory; map = false reads everything.
TEST(MappedLoad, WholeRowsAreAMappingOfTheFileAndTheRestIsRead) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.5f);
  for (const auto& [first, n] : {std::pair<std::int64_t, std::int64_t>{0, rows}, {100, 60}}) {
    const BufferStats before = buffer_stats();
    const LoadedState s = load(dir / "a.h5", request_of(first, n));
    EXPECT_EQ(buffer_stats().allocations - before.allocations, 1u);  // "k" alone
    EXPECT_TRUE(mapped_from(s.tensor("w"), dir / "a.h5"));
    EXPECT_FALSE(mapped_from(s.tensor("k"), dir / "a.h5"));
    expect_rows(s.tensor("w").view(), first, 0.5f);
    const auto k = s.tensor("k").view().as<float>();
    EXPECT_TRUE(std::all_of(k.begin(), k.end(), [](float v) { return v == 0.5f; }));
  }
  const BufferStats before = buffer_stats();
  const LoadedState copied = load(dir / "a.h5", request_of(0, rows), {.map = false});
  EXPECT_EQ(buffer_stats().allocations - before.allocations, 2u);
  EXPECT_FALSE(mapped_from(copied.tensor("w"), dir / "a.h5"));
  expect_rows(copied.tensor("w").view(), 0, 0.5f);
  // The hyperslab method and reads around the page cache read into memory too.
  for (const LoadOptions& o : {LoadOptions{.method = IoMethod::hyperslab}, LoadOptions{.bypass_page_cache = true}}) {
    const LoadedState s = load(dir / "a.h5", request_of(0, rows), o);
    EXPECT_FALSE(mapped_from(s.tensor("w"), dir / "a.h5"));
    expect_rows(s.tensor("w").view(), 0, 0.5f);
  }
}

// Ranks that are threads of one process load through rank 0's reader, lent to them by the group (one
// open file, one mapping): every rank's tensor lies in the one mapping of the file.
TEST(MappedLoad, ThreadRanksLoadThroughOneReaderAndOneMapping) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.25f);
  std::vector<std::optional<LoadedState>> loaded(4);
  run_ranks(4, [&](ProcessGroup& g) {
    const std::int64_t n = rows / 4;
    loaded[static_cast<std::size_t>(g.rank())].emplace(load(dir / "a.h5", request_of(g.rank() * n, n), g));
  });
  std::set<std::uintptr_t> bases;
  for (std::size_t r = 0; r < loaded.size(); ++r) {
    const SharedBuffer& w = loaded[r]->tensor("w");
    expect_rows(w.view(), static_cast<std::int64_t>(r) * (rows / 4), 0.25f);
    bases.insert(mapping_base(w.view().data(), dir / "a.h5"));
  }
  EXPECT_FALSE(bases.contains(0));  // every rank's "w" is mapped
  EXPECT_EQ(bases.size(), 1u) << "the thread ranks mapped the file " << bases.size() << " times";
}

// No two tensors share bytes: thread ranks that ask one reader for the same rows (a tensor every
// rank holds whole) get one tensor over the mapping and copies of their own; once the mapped one is
// gone, its rows are mapped again.
TEST(MappedLoad, TwoTensorsOverTheSameBytesNeverShareMemory) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.25f);
  std::vector<std::optional<LoadedState>> loaded(3);
  run_ranks(3, [&](ProcessGroup& g) {
    loaded[static_cast<std::size_t>(g.rank())].emplace(load(dir / "a.h5", request_of(0, rows), g));
  });
  int mapped = 0;
  for (std::optional<LoadedState>& l : loaded) {
    expect_rows(l->tensor("w").view(), 0, 0.25f);
    mapped += mapped_from(l->tensor("w"), dir / "a.h5") ? 1 : 0;
  }
  EXPECT_EQ(mapped, 1);
  for (std::size_t r = 0; r < loaded.size(); ++r) loaded[r]->tensor("w").mut_view().as<float>()[5] = -1.0f - static_cast<float>(r);
  for (std::size_t r = 0; r < loaded.size(); ++r) EXPECT_EQ(loaded[r]->tensor("w").view().as<float>()[5], -1.0f - static_cast<float>(r));

  const CheckpointReader reader(dir / "a.h5");
  std::optional<LoadedState> first(load(reader, request_of(0, 64)));
  EXPECT_TRUE(mapped_from(first->tensor("w"), dir / "a.h5"));
  const LoadedState overlapping = load(reader, request_of(32, 64));
  EXPECT_FALSE(mapped_from(overlapping.tensor("w"), dir / "a.h5"));
  expect_rows(overlapping.tensor("w").view(), 32, 0.25f);
  const LoadedState beside = load(reader, request_of(64, 64));  // no byte in common: mapped
  EXPECT_TRUE(mapped_from(beside.tensor("w"), dir / "a.h5"));
  first.reset();
  const LoadedState again = load(reader, request_of(0, 64));
  EXPECT_TRUE(mapped_from(again.tensor("w"), dir / "a.h5"));
}

// A mapped tensor is private: writing it changes neither the file nor another load's tensor. It
// outlives the reader, and a save that replaces the file (a rename) leaves it as it was.
TEST(MappedLoad, IsPrivateAndOutlivesTheReaderAndAReplacingSave) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.5f);
  std::optional<LoadedState> kept;
  {
    const CheckpointReader reader(dir / "a.h5");
    kept.emplace(load(reader, request_of(0, rows)));
  }
  SharedBuffer& w = kept->tensor("w");
  ASSERT_TRUE(mapped_from(w, dir / "a.h5"));
  const std::string file_before = file_bytes(dir / "a.h5");
  for (float& v : w.mut_view().as<float>()) v = -1;
  EXPECT_EQ(file_bytes(dir / "a.h5"), file_before);
  const LoadedState again = load(dir / "a.h5", request_of(0, rows));
  expect_rows(again.tensor("w").view(), 0, 0.5f);
  save_tensors(dir / "a.h5", 9.0f);  // replaces the file
  expect_rows(again.tensor("w").view(), 0, 0.5f);
  const LoadedState replaced = load(dir / "a.h5", request_of(0, rows));
  expect_rows(replaced.tensor("w").view(), 0, 9.0f);
}

// Every mapped row is checked: a changed byte is Errc::corrupt naming the key and the row, never a
// tensor with the wrong bytes; without verification the mapping shows the file as it is.
TEST(MappedLoad, EveryMappedRowIsCheckedAgainstItsChecksum) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.5f);
  std::string bytes = file_bytes(dir / "a.h5");
  const float needle = value(200, 3, 0.5f);
  const std::size_t at = offset_of(bytes, needle);
  ASSERT_NE(at, std::string::npos);
  bytes[at + 1] ^= 0x10;
  std::ofstream(dir / "a.h5", std::ios::binary | std::ios::trunc) << bytes;
  const Error e = error_of([&] { (void)load(dir / "a.h5", request_of(0, rows)); });
  EXPECT_EQ(e.code(), Errc::corrupt) << e.what();
  EXPECT_TRUE(testing_support::contains(e.what(), "key w, rows [200, 201)")) << e.what();
  // Rows that do not meet the change load.
  const LoadedState first_rows = load(dir / "a.h5", request_of(0, 200));
  expect_rows(first_rows.tensor("w").view(), 0, 0.5f);
  const LoadedState unchecked = load(dir / "a.h5", request_of(0, rows), {.verify_checksums = false});
  EXPECT_TRUE(mapped_from(unchecked.tensor("w"), dir / "a.h5"));
  EXPECT_NE(unchecked.tensor("w").view().as<float>()[200 * cols + 3], needle);
}

// A file that changed size after the reader checked it is refused before anything is mapped.
TEST(MappedLoad, AFileChangedSinceTheOpenIsRefused) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.5f);
  const CheckpointReader reader(dir / "a.h5");
  std::ofstream(dir / "a.h5", std::ios::binary | std::ios::app) << "more";
  const Error e = error_of([&] { (void)load(reader, request_of(0, rows)); });
  EXPECT_EQ(e.code(), Errc::replaced) << e.what();
  EXPECT_TRUE(testing_support::contains(e.what(), "changed since it was opened")) << e.what();
}

// A parameter's shard is mapped when its pieces fill it without pad rows (TP 1 of a plain weight or
// of a fused one; an unpadded shard), each whole rows of a contiguous dataset; a shard with pad rows,
// or rows of a chunked dataset, is read into memory. A save lays a fused weight's blocks out one
// after another in row order, so at TP 1 the whole weight is one range of the reader's one mapping
// of the file, as a plain weight is, at a multiple of 2 MiB (the kernel's huge pages of the file).
TEST(MappedLoad, ParamsAreMappedWhereTheirPiecesFillTheShard) {
  ScratchDir dir;
  auto c = small_model();
  c.gdp_layers = c.mamba_layers = 6;  // many datasets: HDF5's metadata would fall between them
  c.cols = 4096;  // blocks of 64 KiB or more in whole pages: their data lies aligned in the file
  save_model(c, {2, 2, 8, 1}, dir / "a.h5");
  int mapped = 0, joined = 0, read = 0;
  for (const demo::Layout l : {demo::Layout{1, 1, 0, 1}, demo::Layout{1, 4, 16, 1}}) {
    for (int r = 0; r < l.ranks(); ++r) {
      const StateDict request = demo::request(c, l, r);
      const LoadedState s = load(dir / "a.h5", request);
      EXPECT_EQ(demo::verify(c, {}, r, request, s).mismatches, 0);
      std::set<std::uintptr_t> bases;  // of the mappings the rank's mapped tensors lie in
      for (const ShardedParam& p : request.params()) {
        const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
        std::int64_t rows = 0;
        for (const Piece& piece : plan.pieces) rows += piece.rows;
        // Saved at TP 2, a weight TP splits by columns lies in column chunks (each TP rank's
        // columns contiguous): no row of it is one run of the file.
        const bool runs = !plan.padding_only && rows == p.shard_shape().rows() && p.spec.tp_axis != TpAxis::cols;
        if (s.tensor(p.spec.key).bytes() < (64 << 10)) continue;  // smaller datasets need not lie aligned
        EXPECT_EQ(mapped_from(s.tensor(p.spec.key), dir / "a.h5"), runs) << p.spec.key << " at rank " << r;
        ++(runs ? mapped : read);
        joined += runs && plan.pieces.size() > 1;
        if (runs) bases.insert(mapping_base(s.tensor(p.spec.key).view().data(), dir / "a.h5"));
      }
      if (l.tp == 1 && l.gtp == 1) {
        EXPECT_EQ(bases.size(), 1u) << "at TP 1 every weight, fused or not, lies in one mapping of the file";
        EXPECT_EQ(*bases.begin() % (std::uintptr_t{2} << 20), 0u) << "the mapping starts at a multiple of 2 MiB";
      }
    }
  }
  EXPECT_GT(mapped, 0);
  EXPECT_GT(joined, 0);
  EXPECT_GT(read, 0);
}

// A tensor of parts that follow one another in the file is one range of the reader's mapping of the
// file; parts in another order (or with bytes between them) are joined: each mapped on its own,
// right after the one before, into one range of addresses. Either way its bytes are the parts'.
TEST(MappedLoad, PartsNextToEachOtherInTheFileAreOneRangeOfItsMappingOthersAreJoined) {
  ScratchDir dir;
  constexpr std::int64_t n = 256, width = 1024;        // 1 MiB each, whole pages
  const std::vector<std::string> keys{"a", "b", "c"};  // saved in key order, one after another
  {
    StateDict s;
    for (std::size_t t = 0; t < keys.size(); ++t) {
      SharedBuffer w = SharedBuffer::uninitialized(DType::f32, {n, width});
      auto x = w.mut_view().as<float>();
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(t) * 1e7f + static_cast<float>(i);
      s.add(ShardedTensor::of(keys[t], w, {n, width}, {0, 0}));
    }
    run_ranks(1, [&](ProcessGroup& g) { save(s, dir / "a.h5", g); });
  }
  const CheckpointReader reader(dir / "a.h5");
  const Box whole{{0, n}, {0, width}};
  const std::optional<SharedBuffer> c = reader.map(reader.dataset("c"), whole, Extents{n, width});
  ASSERT_TRUE(c.has_value());
  const std::uintptr_t base = mapping_base(c->view().data(), dir / "a.h5");
  ASSERT_NE(base, 0u);
  const auto joined = [&](std::size_t first, std::size_t second) {
    const std::array<MapPart, 2> parts{MapPart{&reader.dataset(keys[first]), whole},
                                       MapPart{&reader.dataset(keys[second]), whole}};
    std::optional<SharedBuffer> t = reader.map(parts, DType::f32, Extents{2 * n, width});
    EXPECT_TRUE(t.has_value()) << keys[first] << keys[second];
    if (!t) return t;
    EXPECT_TRUE(mapped_from(*t, dir / "a.h5"));
    const auto x = t->view().as<float>();
    const auto half = static_cast<std::size_t>(n * width);
    for (const std::size_t i : {std::size_t{0}, half - 1, std::size_t{12345}})
      EXPECT_EQ(x[i], static_cast<float>(first) * 1e7f + static_cast<float>(i));
    for (const std::size_t i : {std::size_t{0}, half - 1, std::size_t{777}})
      EXPECT_EQ(x[half + i], static_cast<float>(second) * 1e7f + static_cast<float>(i));
    return t;
  };
  // "a" then "b", as the file holds them: the reader's mapping, the one "c" lies in.
  const std::optional<SharedBuffer> ab = joined(0, 1);
  ASSERT_TRUE(ab.has_value());
  EXPECT_EQ(mapping_base(ab->view().data(), dir / "a.h5"), base);
  EXPECT_EQ(mapping_base(ab->view().data() + ab->bytes() - 1, dir / "a.h5"), base);
  // "b" then "a": joined runs, outside the reader's mapping; each half a mapping of its own part.
  const std::optional<SharedBuffer> ba = joined(1, 0);
  ASSERT_TRUE(ba.has_value());
  const std::uintptr_t first = mapping_base(ba->view().data(), dir / "a.h5");
  const std::uintptr_t second = mapping_base(ba->view().data() + ba->bytes() / 2, dir / "a.h5");
  EXPECT_NE(first, base);
  EXPECT_NE(second, base);
  EXPECT_NE(first, second);
}

// A file cut short inside a dataset's bytes is refused with the reason: nothing is mapped over
// bytes the file does not have.
TEST(MappedLoad, AFileCutShortIsRefusedNotMapped) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.5f);
  const std::string bytes = file_bytes(dir / "a.h5");
  const std::size_t at = offset_of(bytes, value(200, 3, 0.5f));
  ASSERT_NE(at, std::string::npos);
  std::filesystem::resize_file(dir / "a.h5", at);
  const Error e = error_of([&] { (void)load(dir / "a.h5", request_of(0, rows), {.notice = [](std::string_view) {}}); });
  EXPECT_EQ(e.code(), Errc::not_a_checkpoint) << e.what();
}

// A file cut short by another program after the reader mapped it: a later load over that mapping
// is refused naming the file where a read of the lost pages would have raised SIGBUS, because the
// pages are brought in before any row is checked (MADV_POPULATE_READ reports the lost page).
TEST(MappedLoad, AFileCutShortUnderTheMappingIsRefusedNotASigbus) {
  if (!populate_read_supported()) GTEST_SKIP() << "MADV_POPULATE_READ needs Linux 5.14 or later";
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.5f);
  const CheckpointReader reader(dir / "a.h5");
  {
    const LoadedState first = load(reader, request_of(0, 64));  // maps the file
    ASSERT_TRUE(mapped_from(first.tensor("w"), dir / "a.h5"));
  }
  const std::string bytes = file_bytes(dir / "a.h5");
  const std::size_t at = offset_of(bytes, value(200, 3, 0.5f));
  ASSERT_NE(at, std::string::npos);
  std::filesystem::resize_file(dir / "a.h5", at / 4096 * 4096);  // rows 200 on lie in no page of it
  const Error e = error_of([&] { (void)load(reader, request_of(0, rows)); });
  EXPECT_EQ(e.code(), Errc::replaced) << e.what();
  EXPECT_TRUE(testing_support::contains(e.what(), "changed under its mapping")) << e.what();
}

// A tensor of many megabytes is checked on several threads (runs of 1 MiB of rows in file order):
// a change in a late run is found whichever thread checks it, of two changes far apart the first in
// row order is the one named, and the progress told adds up to the tensor's bytes.
TEST(MappedLoad, ALargeTensorIsCheckedOnThreadsAndTheFirstChangedRowIsNamed) {
  ScratchDir dir;
  constexpr std::int64_t n = 4096, width = 1024;  // 16 MiB: 16 runs of 256 rows
  const auto at = [](std::int64_t r, std::int64_t c) { return static_cast<float>(r) * 4096.0f + static_cast<float>(c); };
  save_big<float>(dir / "a.h5", n, width, at);
  const StateDict request = big_request(DType::f32, n, width);
  std::int64_t told = 0;
  {
    const LoadedState s = load(dir / "a.h5", request, {.progress = [&](std::int64_t b) { told += b; }});
    ASSERT_TRUE(mapped_from(s.tensor("big"), dir / "a.h5"));
    EXPECT_EQ(told, n * width * 4);
    EXPECT_EQ(s.tensor("big").view().as<float>()[4000 * width + 7], at(4000, 7));
  }
  const std::string saved = file_bytes(dir / "a.h5");
  const auto change = [&](std::string bytes, std::int64_t r) {
    const std::size_t where = offset_of(bytes, at(r, 5));
    EXPECT_NE(where, std::string::npos) << "row " << r;
    if (where != std::string::npos) bytes[where + 1] ^= 0x10;
    return bytes;
  };
  const auto refused = [&](const std::string& bytes) {
    std::ofstream(dir / "a.h5", std::ios::binary | std::ios::trunc) << bytes;
    return error_of([&] { (void)load(dir / "a.h5", request); });
  };
  const Error late = refused(change(saved, 4090));
  EXPECT_EQ(late.code(), Errc::corrupt) << late.what();
  EXPECT_TRUE(testing_support::contains(late.what(), "key big, rows [4090, 4091)")) << late.what();
  const Error both = refused(change(change(saved, 3900), 700));
  EXPECT_EQ(both.code(), Errc::corrupt) << both.what();
  EXPECT_TRUE(testing_support::contains(both.what(), "key big, rows [700, 701)")) << both.what();
}

// Threads that share one reader from its open on share what it looks up: one entry per dataset (the
// same Dataset for each), one mapping of the file, one reader around the page cache, made once
// whichever thread asks first; every thread's rows are right, mapped or read.
TEST(MappedLoad, ThreadsOfOneReaderShareWhatItLooksUpOnce) {
  ScratchDir dir;
  save_tensors(dir / "a.h5", 0.75f);
  const CheckpointReader reader(dir / "a.h5");
  constexpr std::size_t threads = 8;
  std::vector<const Dataset*> seen(threads);
  std::vector<std::optional<LoadedState>> loaded(threads);
  {
    std::vector<std::jthread> workers;
    for (std::size_t t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        seen[t] = &reader.dataset("w");
        const LoadOptions o = t % 2 == 0 ? LoadOptions{} : LoadOptions{.bypass_page_cache = true};
        loaded[t].emplace(load(reader, request_of(static_cast<std::int64_t>(t) * 32, 32), o));
      });
  }
  std::set<std::uintptr_t> bases;
  for (std::size_t t = 0; t < threads; ++t) {
    EXPECT_EQ(seen[t], seen[0]) << "thread " << t << " has a Dataset of its own";
    const SharedBuffer& w = loaded[t]->tensor("w");
    expect_rows(w.view(), static_cast<std::int64_t>(t) * 32, 0.75f);
    EXPECT_EQ(mapped_from(w, dir / "a.h5"), t % 2 == 0) << "thread " << t;
    if (t % 2 == 0) bases.insert(mapping_base(w.view().data(), dir / "a.h5"));
  }
  EXPECT_EQ(bases.size(), 1u) << "one reader mapped the file " << bases.size() << " times";
}

// Several tensors mapped in one batch (CheckpointReader::map_all) are what map() gives for each, in
// the order asked whatever the order of the file; a request that cannot be mapped gets nothing and
// leaves the others mapped; the progress told adds up to the bytes checked; and of two changed rows
// in two tensors the one first in the file is named, though its tensor was asked for after the other.
TEST(MappedLoad, ABatchOfTensorsIsCheckedInOnePassAndTheFirstChangeInTheFileIsNamed) {
  ScratchDir dir;
  constexpr std::int64_t n = 512, width = 1024;  // 2 MiB each: two runs of 1 MiB
  const std::vector<std::string> keys{"a", "b", "c", "d"};
  const auto at = [](std::size_t t, std::int64_t r, std::int64_t c) {
    return static_cast<float>(t) * 1e6f + static_cast<float>(r) * 1024.0f + static_cast<float>(c);
  };
  {
    StateDict s;
    for (std::size_t t = 0; t < keys.size(); ++t) {
      SharedBuffer w = SharedBuffer::uninitialized(DType::f32, {n, width});
      auto x = w.mut_view().as<float>();
      for (std::int64_t r = 0; r < n; ++r)
        for (std::int64_t c = 0; c < width; ++c) x[static_cast<std::size_t>(r * width + c)] = at(t, r, c);
      s.add(ShardedTensor::of(keys[t], w, {n, width}, {0, 0}));
    }
    run_ranks(1, [&](ProcessGroup& g) { save(s, dir / "a.h5", g); });
  }
  const Box whole{{0, n}, {0, width}};
  const std::vector<std::size_t> asked{3, 1, 0, 2};  // not the order of the file
  const auto batch = [&](const CheckpointReader& reader, std::vector<std::array<MapPart, 1>>& parts) {
    std::vector<MapRequest> requests;
    for (const std::size_t t : asked) parts.push_back({MapPart{&reader.dataset(keys[t]), whole}});
    for (const auto& p : parts) requests.push_back({p, DType::f32, Extents{n, width}});
    requests.push_back({});  // no parts: nothing to map
    return requests;
  };
  {
    const CheckpointReader reader(dir / "a.h5");
    std::vector<std::array<MapPart, 1>> parts;
    const std::vector<MapRequest> requests = batch(reader, parts);
    std::int64_t told = 0;
    const std::vector<std::optional<SharedBuffer>> got =
        reader.map_all(requests, {.progress = [&](std::int64_t b) { told += b; }});
    ASSERT_EQ(got.size(), requests.size());
    EXPECT_FALSE(got.back().has_value());
    EXPECT_EQ(told, static_cast<std::int64_t>(keys.size()) * n * width * 4);
    for (std::size_t i = 0; i < asked.size(); ++i) {
      ASSERT_TRUE(got[i].has_value()) << keys[asked[i]];
      EXPECT_TRUE(mapped_from(*got[i], dir / "a.h5")) << keys[asked[i]];
      // The same bytes again from this reader while the batch's tensor lives: not mapped (the two
      // would be one memory); from a reader of its own, mapped alike.
      EXPECT_FALSE(reader.map(reader.dataset(keys[asked[i]]), whole, Extents{n, width}).has_value()) << keys[asked[i]];
      const CheckpointReader other(dir / "a.h5");
      const std::optional<SharedBuffer> one = other.map(other.dataset(keys[asked[i]]), whole, Extents{n, width});
      ASSERT_TRUE(one.has_value());
      ASSERT_EQ(std::memcmp(one->view().data(), got[i]->view().data(), got[i]->bytes()), 0) << keys[asked[i]];
      EXPECT_EQ(got[i]->view().as<float>()[300 * width + 9], at(asked[i], 300, 9)) << keys[asked[i]];
    }
  }
  // A change at the end of the tensor first in the file and one at the start of the tensor last in
  // the file: the first in the file is named, though the tensor holding it was asked for after the other.
  std::string bytes = file_bytes(dir / "a.h5");
  std::vector<std::size_t> where;
  for (std::size_t t = 0; t < keys.size(); ++t) where.push_back(offset_of(bytes, at(t, 0, 5)));
  for (const std::size_t w : where) ASSERT_NE(w, std::string::npos);
  const auto first = static_cast<std::size_t>(std::min_element(where.begin(), where.end()) - where.begin());
  const auto last = static_cast<std::size_t>(std::max_element(where.begin(), where.end()) - where.begin());
  ASSERT_NE(first, last);
  const std::size_t early = offset_of(bytes, at(first, n - 1, 5)), late = offset_of(bytes, at(last, 0, 5));
  ASSERT_LT(early, late);
  bytes[early + 1] ^= 0x10;
  bytes[late + 1] ^= 0x10;
  std::ofstream(dir / "a.h5", std::ios::binary | std::ios::trunc) << bytes;
  const CheckpointReader reader(dir / "a.h5");
  std::vector<std::array<MapPart, 1>> parts;
  const std::vector<MapRequest> requests = batch(reader, parts);
  const Error e = error_of([&] { (void)reader.map_all(requests); });
  EXPECT_EQ(e.code(), Errc::corrupt) << e.what();
  EXPECT_TRUE(testing_support::contains(e.what(), "key " + keys[first] + ", rows [511, 512)")) << e.what();
}

// The checksums of a batch are read in one go where they lie together in the checksum table, and run
// by run where they lie far apart (a few rows of a long tensor and a short tensor saved after it):
// both ways every row is checked against its own checksum, and a changed row is named.
TEST(MappedLoad, ChecksumsFarApartInTheTableAreReadRunByRun) {
  ScratchDir dir;
  constexpr std::int64_t long_rows = 150000, short_rows = 16;  // 150,000 checksums lie between them
  {
    SharedBuffer a = SharedBuffer::uninitialized(DType::f32, {long_rows, 1});
    auto x = a.mut_view().as<float>();
    for (std::int64_t r = 0; r < long_rows; ++r) x[static_cast<std::size_t>(r)] = static_cast<float>(r) + 0.25f;
    SharedBuffer b = SharedBuffer::uninitialized(DType::f32, {short_rows, 1});
    auto y = b.mut_view().as<float>();
    for (std::int64_t r = 0; r < short_rows; ++r) y[static_cast<std::size_t>(r)] = -1000.5f - static_cast<float>(r);
    StateDict s;
    s.add(ShardedTensor::of("a", a, {long_rows, 1}, {0, 0}));
    s.add(ShardedTensor::of("b", b, {short_rows, 1}, {0, 0}));
    run_ranks(1, [&](ProcessGroup& g) { save(s, dir / "a.h5", g); });
  }
  const auto request = [&](std::int64_t first) {
    StateDict r;
    r.add(ShardedTensor::expect("a", DType::f32, {short_rows, 1}, {long_rows, 1}, {first, 0}));
    r.add(ShardedTensor::expect("b", DType::f32, {short_rows, 1}, {short_rows, 1}, {0, 0}));
    return r;
  };
  for (const std::int64_t first : {std::int64_t{0}, long_rows - short_rows}) {  // far from b's, and next to them
    const LoadedState s = load(dir / "a.h5", request(first));
    ASSERT_TRUE(mapped_from(s.tensor("a"), dir / "a.h5"));
    ASSERT_TRUE(mapped_from(s.tensor("b"), dir / "a.h5"));
    EXPECT_EQ(s.tensor("a").view().as<float>()[5], static_cast<float>(first + 5) + 0.25f);
    EXPECT_EQ(s.tensor("b").view().as<float>()[7], -1007.5f);
  }
  std::string bytes = file_bytes(dir / "a.h5");
  const std::size_t at = offset_of(bytes, -1003.5f);  // b's row 3
  ASSERT_NE(at, std::string::npos);
  bytes[at + 1] ^= 0x10;
  std::ofstream(dir / "a.h5", std::ios::binary | std::ios::trunc) << bytes;
  for (const std::int64_t first : {std::int64_t{0}, long_rows - short_rows}) {
    const Error e = error_of([&] { (void)load(dir / "a.h5", request(first)); });
    EXPECT_EQ(e.code(), Errc::corrupt) << e.what();
    EXPECT_TRUE(testing_support::contains(e.what(), "key b, rows [3, 4)")) << e.what();
  }
}

// A batch of many times the pages the calling thread may fall behind by before others help it check
// (32 MiB) comes in from one stream: every row is right and checked, the progress adds up, and of two
// changed rows far apart the first in the file is named whichever thread checked each (a warm page
// cache, as here after the save, lets the stream run ahead of the checks).
TEST(MappedLoad, ALargeBatchIsBroughtInAndEveryRowChecked) {
  ScratchDir dir;
  constexpr std::int64_t width = 4096, n = 8192;  // 16 KiB rows: 128 MiB, 8 stretches of 16 MiB
  constexpr std::int64_t row_bytes = width * 4, chunk_rows = (std::int64_t{16} << 20) / row_bytes;
  const auto at = [](std::int64_t r, std::int64_t c) { return static_cast<std::int32_t>(r * 4096 + c); };
  save_big<std::int32_t>(dir / "a.h5", n, width, at);
  const StateDict request = big_request(DType::i32, n, width);
  {
    std::int64_t told = 0;
    const LoadedState s = load(dir / "a.h5", request, {.progress = [&](std::int64_t b) { told += b; }});
    ASSERT_TRUE(mapped_from(s.tensor("big"), dir / "a.h5"));
    EXPECT_EQ(told, n * row_bytes);
    const auto x = s.tensor("big").view().as<std::int32_t>();
    for (const std::int64_t r : {std::int64_t{0}, chunk_rows + 3, 6 * chunk_rows + 1, n - 1})
      EXPECT_EQ(x[static_cast<std::size_t>(r * width + 9)], at(r, 9)) << "row " << r;
  }
  // Where row 0 lies in the file: the rows follow it (a contiguous dataset).
  std::size_t row0 = std::string::npos;
  {
    std::ifstream f(dir / "a.h5", std::ios::binary);
    std::string head(std::size_t{4} << 20, '\0');
    f.read(head.data(), static_cast<std::streamsize>(head.size()));
    head.resize(static_cast<std::size_t>(f.gcount()));
    std::string first_row(row_bytes, '\0');
    for (std::int64_t c = 0; c < width; ++c) {
      const std::int32_t v = at(0, c);
      std::memcpy(first_row.data() + c * 4, &v, 4);
    }
    row0 = head.find(first_row);
  }
  ASSERT_NE(row0, std::string::npos);
  const auto flip = [&](std::int64_t r) {
    std::fstream f(dir / "a.h5", std::ios::binary | std::ios::in | std::ios::out);
    const auto where = static_cast<std::streamoff>(row0 + static_cast<std::size_t>(r * row_bytes + 21));
    char b = 0;
    f.seekg(where);
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x10);
    f.seekp(where);
    f.write(&b, 1);
  };
  const std::int64_t early = chunk_rows + 3, late = 6 * chunk_rows + 1;  // 16 MiB and 96 MiB in
  flip(late);
  flip(early);
  const Error e = error_of([&] { (void)load(dir / "a.h5", request); });
  EXPECT_EQ(e.code(), Errc::corrupt) << e.what();
  EXPECT_TRUE(testing_support::contains(e.what(), "key big, rows [" + std::to_string(early) + ", ")) << e.what();
  flip(early);
  const Error only = error_of([&] { (void)load(dir / "a.h5", request); });
  EXPECT_EQ(only.code(), Errc::corrupt) << only.what();
  EXPECT_TRUE(testing_support::contains(only.what(), "key big, rows [" + std::to_string(late) + ", ")) << only.what();
}

// A file cut short by another program while a load checks rows whose pages the pager already
// brought in: the kernel takes those pages back from the mapping, and the check that meets one is
// Errc::replaced naming the file, never SIGBUS (io::run_guarded around the hashing).
TEST(MappedLoad, AFileCutShortWhileItsMappedRowsAreCheckedIsReplacedNotASigbus) {
  ScratchDir dir;
  constexpr std::int64_t n = 4096, width = 1024;  // 16 MiB, in the page cache since the save
  save_big<float>(dir / "a.h5", n, width, [](std::int64_t r, std::int64_t c) { return static_cast<float>(r + c); });
  std::atomic<bool> cut{false};
  const Error e = error_of([&] {
    (void)load(dir / "a.h5", big_request(DType::f32, n, width), {.progress = [&](std::int64_t) {
                 if (cut.exchange(true)) return;
                 // The pager is far ahead by then: the rows next checked lie in pages it brought in.
                 std::this_thread::sleep_for(std::chrono::milliseconds(100));
                 std::filesystem::resize_file(dir / "a.h5", 4096);
               }});
  });
  EXPECT_TRUE(cut.load());
  EXPECT_EQ(e.code(), Errc::replaced) << e.what();
  EXPECT_TRUE(testing_support::contains(e.what(), (dir / "a.h5").string())) << e.what();
  EXPECT_TRUE(testing_support::contains(e.what(), "changed under its mapping")) << e.what();
}

// After a load returned, a file cut short under the mapping its tensors lie in: where the library
// reads those tensors (a save of them, as `shardckpt reshard` does; a copy of their rows between
// ranks) the lost pages are Errc::replaced naming the file, and the save commits nothing.
TEST(MappedLoad, ATensorOverAFileCutShortLaterIsAnErrorWhereTheLibraryReadsIt) {
  ScratchDir dir;
  constexpr std::int64_t n = 1024, width = 1024;  // 4 MiB
  save_big<float>(dir / "a.h5", n, width, [](std::int64_t r, std::int64_t c) { return static_cast<float>(r - c); });
  const LoadedState loaded = load(dir / "a.h5", big_request(DType::f32, n, width));
  const SharedBuffer& big = loaded.tensor("big");
  ASSERT_TRUE(mapped_from(big, dir / "a.h5"));
  std::filesystem::resize_file(dir / "a.h5", 4096);
  std::vector<std::byte> copy(big.bytes());
  const Error copied = error_of([&] { io::copy_guarded(copy.data(), big.view().data(), big.bytes()); });
  EXPECT_EQ(copied.code(), Errc::replaced) << copied.what();
  EXPECT_TRUE(testing_support::contains(copied.what(), (dir / "a.h5").string())) << copied.what();
  for (const bool checksums : {true, false}) {
    StateDict s;
    s.add(ShardedTensor::of("big", TensorRef::read_only(big), {n, width}, {0, 0}));
    const Error saved = error_of([&] {
      run_ranks(1, [&](ProcessGroup& g) { save(s, dir / "b.h5", g, {.checksums = checksums}); });
    });
    EXPECT_EQ(saved.code(), Errc::replaced) << saved.what();
    EXPECT_TRUE(testing_support::contains(saved.what(), (dir / "a.h5").string())) << saved.what();
    EXPECT_FALSE(std::filesystem::exists(dir / "b.h5"));
  }
}

// What a mapping cannot guard against: code outside the library touching a lost page of a tensor
// over a file cut short after the load returned gets SIGBUS, as with any mapping (map = false is the
// guard), and the library's handler first names the file on stderr.
TEST(MappedLoadDeathTest, UserCodeTouchingALostPageAfterTheLoadDiesBySigbusNamingTheFile) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ScratchDir dir;
  save_big<float>(dir / "a.h5", 1024, 1024, [](std::int64_t r, std::int64_t c) { return static_cast<float>(r * c); });
  EXPECT_EXIT(
      {
        const LoadedState loaded = load(dir / "a.h5", big_request(DType::f32, 1024, 1024));
        std::filesystem::resize_file(dir / "a.h5", 4096);
        const auto x = loaded.tensor("big").view().as<float>();
        const float v = *static_cast<const volatile float*>(&x[x.size() - 1]);
        std::fprintf(stderr, "read %f\n", static_cast<double>(v));
        std::exit(0);
      },
      // Under AddressSanitizer the fault is passed on to its own handler, which reports it and exits 1.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
      testing::ExitedWithCode(1),
#else
      testing::KilledBySignal(SIGBUS),
#endif
#else
      testing::KilledBySignal(SIGBUS),
#endif
      "a.h5: the file was cut short by another program under a mapping");
}
