// Band chunking past dim 1 (docs/format.md, "Tensor datasets"): a layer-stacked row-parallel weight,
// (L, h, f) split by TP on its last dim, is chunked one band of dim 2 wide, so that a rank's part of
// it is one byte range of the file rather than a run per (layer, row of dim 1); the raw path
// addresses every run of such a chunk, the writer sends a rank's runs out as one write, and reads at
// any split, through either method, are checked.
#include <fstream>

#include "support.hpp"

namespace {

constexpr std::int64_t L = 3, h = 4, f = 6, band = 3;  // two TP ranks, each one band of dim 2
const std::vector<std::int64_t> shape{L, h, f};

float value(std::int64_t l, std::int64_t a, std::int64_t c) { return static_cast<float>((l * h + a) * f + c) + 0.25f; }

// The write system calls this process has made (/proc/self/io), or -1.
std::int64_t write_calls() {
  std::ifstream io("/proc/self/io");
  std::string name;
  std::int64_t n = 0;
  while (io >> name >> n)
    if (name == "syscw:") return n;
  return -1;
}

// Each TP rank's slab, cut as a save cuts it: one part per (layer, row of dim 1).
std::vector<SlabPart> parts_of(std::int64_t tp_rank) {
  return slab_parts("w", shape, std::vector<std::int64_t>{0, 0, tp_rank * band}, std::vector<std::int64_t>{L, h, band});
}

struct Written {
  Skeleton skeleton;
  std::int64_t write_calls = 0;  // of the pieces, without the skeleton
};

// The dataset as a save makes it from both ranks' claims, written part by part (`method`).
Written write_bands(const std::filesystem::path& path, IoMethod method) {
  std::vector<Claim> claims;
  std::vector<std::int64_t> firsts;
  for (std::int64_t t : {0, 1})
    for (const SlabPart& p : parts_of(t)) {
      firsts.push_back(static_cast<std::int64_t>(claims.size()));  // one row each: one checksum each
      claims.push_back({"w", DType::f32, shape, p.box, static_cast<int>(t), true});
    }
  const std::vector<Dataset> datasets = datasets_of(claims, firsts);
  io::File file = io::File::create(path);
  Written out{create_skeleton(file, datasets, {CheckpointKind::global, {}, {}, std::string(32, 'b')},
                              static_cast<std::int64_t>(claims.size())),
              0};
  const std::int64_t before = write_calls();
  {
    PieceWriter w(file, method, ChecksumSlot{out.skeleton.checksums_address, 0});
    for (std::int64_t t : {0, 1})
      for (const SlabPart& p : parts_of(t)) {
        HostBuffer run = HostBuffer::zeros(DType::f32, {1, band});
        const std::int64_t l = p.box.rows.begin, a = p.box.cols.begin / f;
        for (std::int64_t c = 0; c < band; ++c)
          run.mut_view().as<float>()[static_cast<std::size_t>(c)] = value(l, a, t * band + c);
        w.write(out.skeleton.datasets[0], p.box, run.view());
      }
    (void)w.finish();
  }
  out.write_calls = write_calls() - before;
  mark_complete(file, out.skeleton.data);
  return out;
}

// Reads dim-2 columns [c0, c0 + n) of every layer and row of dim 1, a run each (as a load at another
// split reads them), then (`whole`) every layer in one read, and checks every value.
void expect_columns(const CheckpointReader& r, std::int64_t c0, std::int64_t n, IoMethod method, bool whole = true) {
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t a = 0; a < h; ++a) {
      HostBuffer b = HostBuffer::zeros(DType::f32, {1, n});
      r.read(r.dataset("w"), Box{{l, l + 1}, {a * f + c0, a * f + c0 + n}}, b.mut_view(), {method});
      const auto v = b.view().as<float>();
      for (std::int64_t c = 0; c < n; ++c)
        ASSERT_EQ(v[static_cast<std::size_t>(c)], value(l, a, c0 + c)) << l << " " << a << " " << c0 + c;
    }
  if (!whole) return;
  // Whole layers at once: every run of both chunks in one read.
  HostBuffer all = HostBuffer::zeros(DType::f32, {L, h * f});
  r.read(r.dataset("w"), whole_box(shape), all.mut_view(), {method});
  for (std::int64_t i = 0; i < L * h * f; ++i)
    ASSERT_EQ(all.view().as<float>()[static_cast<std::size_t>(i)], value(0, 0, i)) << i;
}

}  // namespace

TEST(Bands, ARowParallelWeightSplitOnItsLastDimIsChunkedOneBandWide) {
  ScratchDir dir;
  const Written raw = write_bands(dir / "raw.h5", IoMethod::raw);
  const Dataset& d = raw.skeleton.datasets[0];
  // What the policy chose: chunks of every layer and row of dim 1, one band of dim 2 wide.
  ASSERT_EQ(d.key, "w");
  ASSERT_EQ(d.regions.size(), 2u);
  for (std::size_t t = 0; t < 2; ++t) {
    const RawRegion& e = d.regions[t];
    EXPECT_EQ(e.box, (Box{{0, L}, {static_cast<std::int64_t>(t) * band, static_cast<std::int64_t>(t + 1) * band}}));
    EXPECT_EQ(e.runs, h);    // a run per row of dim 1 in each layer
    EXPECT_EQ(e.period, f);  // the elements of one row of dim 1
  }
  // h5py and HDF5 see the same chunks, at the addresses the raw path writes to.
  if (have_python_module("h5py")) {
    EXPECT_EQ(run_python("import h5py, sys\nd = h5py.File(sys.argv[1], 'r')['w']\nassert d.chunks == (3, 4, 3), d.chunks\n"
                         "at = [d.id.get_chunk_info_by_coord((0, 0, c)).byte_offset for c in (0, 3)]\n"
                         "assert at == [int(sys.argv[2]), int(sys.argv[3])], at\n",
                         (dir / "raw.h5").string() + " " + std::to_string(d.regions[0].address) + " " +
                             std::to_string(d.regions[1].address)),
              0);
  }
  // The 24 runs of 12 bytes went out gathered: a rank's runs lie one after another in its chunk.
  ASSERT_GE(raw.write_calls, 0) << "no /proc/self/io";
  EXPECT_LE(raw.write_calls, 4) << "writes of the runs and the checksums";
  // The other write path makes the same dataset, and every split reads back the same values, checked.
  const Written hyper = write_bands(dir / "hyper.h5", IoMethod::hyperslab);
  EXPECT_TRUE(testing_support::same_tensors(dir / "raw.h5", dir / "hyper.h5"));
  EXPECT_TRUE(testing_support::same_checksums(dir / "raw.h5", dir / "hyper.h5"));
  for (const char* name : {"raw.h5", "hyper.h5"}) {
    const CheckpointReader r(dir / name);
    for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
      expect_columns(r, 0, f, m);     // whole rows: both bands, every run
      expect_columns(r, 2, 2, m);     // across the two bands
      expect_columns(r, 4, 1, m);     // inside the second band
    }
    EXPECT_EQ(verify_checkpoint(r).mismatches, 0);
  }
}

TEST(Bands, AFlippedByteInAChunkIsFoundOnEveryPath) {
  ScratchDir dir;
  const Written raw = write_bands(dir / "c.h5", IoMethod::raw);
  // Layer 1, row 2 of dim 1, dim-2 column 4: in the second chunk, run (1 * h + 2), element 1.
  flip_byte(dir / "c.h5", raw.skeleton.datasets[0].regions[1].address + ((1 * h + 2) * band + 1) * sizeof(float));
  const CheckpointReader r(dir / "c.h5");
  for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
    const Error e = error_of([&] { expect_columns(r, 4, 1, m, false); });
    EXPECT_EQ(e.code(), Errc::corrupt);
    EXPECT_TRUE(contains(e.what(), "key w") && contains(e.what(), "rows [1, 2)")) << e.what();
    expect_columns(r, 0, band, m, false);  // the first band reads cleanly, run by run
  }
  EXPECT_EQ(verify_checkpoint(r).mismatches, 1);
}
