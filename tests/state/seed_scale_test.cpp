// Tests for shardckpt.state at the seed's scale: full, partly padded and padding-only ranks on the
// global and the local path, in bf16 and f32, written by address (IoMethod::raw) and through hyperslabs.
#include "support.hpp"

// The seed's scale: 61,760 rows over GTP 64 at alignment 32, 2 columns, in bf16 and f32, written
// by address and through hyperslabs. Rank 63 is padding-only, rank 62 holds 256 real rows and 736 pad
// rows, the others are full. Besides the fused GTP weight every rank holds an ordinary split
// factory (no GTP: three blocks, TP-split over the 64 ranks), common values and local values.
class SeedScale : public ::testing::TestWithParam<std::tuple<DType, IoMethod>> {
 protected:
  static constexpr int G = 64;
  static constexpr std::int64_t L = 992;
  const ParamSpec fused{"mixer.in_proj.weight", {{"x", 40'000}, {"B", 21'760}}, {2}, TpAxis::rows, 1, {}};
  const ParamSpec split{"mixer.gate.weight", {{"a", 3}, {"b", 5}, {"c", 2}}, {2}, TpAxis::rows, G, {}};

  DType dtype() const { return std::get<0>(GetParam()); }
  IoMethod method() const { return std::get<1>(GetParam()); }
  ShardedParam fused_param(int g) const { return {fused, G, 32, {0, g}, dtype()}; }
  ShardedParam split_param(int g) const { return {split, 1, 0, {g, 0}, dtype()}; }
  static std::int64_t real_rows(int g) { return GtpGeometry::make(61'760, G, 32).real_count(g); }

  // Element codes: non-zero, exact in f32, and a bf16's bits as they are, so that every element
  // is compared exactly (a bf16 rounding would hide a shifted row).
  static std::uint32_t code(std::int64_t i) { return static_cast<std::uint32_t>(i % 65'521) + 1; }
  static std::uint32_t fused_code(std::int64_t row, std::int64_t col) { return code(row * 2 + col); }
  static std::uint32_t split_code(int g, std::int64_t row, std::int64_t col) {
    return code(500'000 + (g * 10 + row) * 2 + col);
  }
  static void put(MutTensorView v, std::size_t i, std::uint32_t x) {
    if (v.dtype() == DType::f32)
      v.as<float>()[i] = static_cast<float>(x);
    else
      v.as<bf16>()[i] = bf16::from_bits(static_cast<std::uint16_t>(x));
  }
  static std::uint32_t get(TensorView v, std::size_t i) {
    return v.dtype() == DType::f32 ? static_cast<std::uint32_t>(v.as<float>()[i]) : v.as<bf16>()[i].bits();
  }

  struct Rank {
    SharedBuffer fused, split;
    StateDict state;
  };
  Rank build(int g) const {
    Rank r;
    ShardedParam f = fused_param(g), s = split_param(g);
    r.fused = SharedBuffer::zeros(dtype(), f.shard_shape());
    r.split = SharedBuffer::zeros(dtype(), s.shard_shape());
    for (std::int64_t row = 0; row < real_rows(g); ++row)
      for (int c = 0; c < 2; ++c)
        put(r.fused.mut_view(), static_cast<std::size_t>(row * 2 + c), fused_code(g * L + row, c));
    for (std::int64_t row = 0; row < 10; ++row)
      for (int c = 0; c < 2; ++c) put(r.split.mut_view(), static_cast<std::size_t>(row * 2 + c), split_code(g, row, c));
    f.shard = r.fused;
    s.shard = r.split;
    r.state.add(f);
    r.state.add(s);
    r.state.add_common("iteration", std::int64_t{42});
    r.state.add_common("note", std::string("seed"));
    r.state.add_common("lr", 0.25);
    r.state.add_local("rng", std::int64_t{1000 + g});
    r.state.add_local("host", "node-" + std::to_string(g));
    return r;
  }
  StateDict request(int g, bool split_too = true) const {
    StateDict s;
    s.add(fused_param(g));
    if (split_too) s.add(split_param(g));
    s.add_local("rng", std::int64_t{1000 + g});
    s.add_local("host", "node-" + std::to_string(g));
    return s;
  }
  // The request with destinations whose every byte is 0xff: a load must write every one of them.
  StateDict poisoned(int g, std::vector<SharedBuffer>& keep) const {
    StateDict s;
    for (ShardedParam p : {fused_param(g), split_param(g)}) {
      keep.push_back(SharedBuffer::uninitialized(p.dtype, p.shard_shape()));
      std::memset(keep.back().mut_view().data(), 0xff, keep.back().bytes());
      p.shard = keep.back();
      s.add(std::move(p));
    }
    s.add_local("rng", std::int64_t{1000 + g});
    s.add_local("host", "node-" + std::to_string(g));
    return s;
  }

  // The fused shard: its real rows as saved and zero pad rows, (992, 2) of the requested dtype in
  // host memory (for the padding-only rank too).
  void check_fused(int g, TensorView f) const {
    ASSERT_EQ(f.shape(), (Extents{L, 2})) << g;
    ASSERT_EQ(f.dtype(), dtype()) << g;
    ASSERT_EQ(f.space(), MemorySpace::host()) << g;
    for (std::int64_t r = 0; r < L; ++r)
      for (int c = 0; c < 2; ++c)
        ASSERT_EQ(get(f, static_cast<std::size_t>(r * 2 + c)), r < real_rows(g) ? fused_code(g * L + r, c) : 0u)
            << "rank " << g << " row " << r << " column " << c;
  }
  void check_split(int g, TensorView s) const {
    ASSERT_EQ(s.shape(), (Extents{10, 2})) << g;
    ASSERT_EQ(s.dtype(), dtype()) << g;
    for (std::int64_t r = 0; r < 10; ++r)
      for (int c = 0; c < 2; ++c)
        ASSERT_EQ(get(s, static_cast<std::size_t>(r * 2 + c)), split_code(g, r, c)) << "rank " << g << " row " << r;
  }
  static void check_values(int g, const Values& v) {
    EXPECT_EQ(v.size(), 5u) << g;
    EXPECT_EQ(std::get<std::int64_t>(v.at("iteration")), 42);
    EXPECT_EQ(std::get<std::string>(v.at("note")), "seed");
    EXPECT_EQ(std::get<double>(v.at("lr")), 0.25);
    EXPECT_EQ(std::get<std::int64_t>(v.at("rng")), 1000 + g);
    EXPECT_EQ(std::get<std::string>(v.at("host")), "node-" + std::to_string(g));
  }
  void check(int g, const LoadedState& s) const {
    check_fused(g, s.tensor(fused.key).view());
    check_split(g, s.tensor(split.key).view());
    check_values(g, s.values());
  }
  void check(int g, const StateDict& filled, const Values& values) const {
    check_fused(g, filled.params()[0].shard.view());
    check_split(g, filled.params()[1].shard.view());
    check_values(g, values);
  }

  // Saves all 64 ranks as one global checkpoint; the padding-only rank has no piece of the fused weight.
  void save_global(const std::filesystem::path& path) const {
    run_ranks(G, [&](ProcessGroup& g) {
      const Rank r = build(g.rank());
      const SavePlan plan = prepare_save(r.state);
      std::int64_t fused_items = 0;
      for (const SaveItem& i : plan.items) fused_items += i.key.starts_with(fused.key);
      EXPECT_EQ(fused_items, g.rank() == 63 ? 0 : g.rank() == 40 ? 2 : 1) << g.rank();  // rank 40 holds x and B
      save(r.state, path, g, {method()});
    });
  }
};

INSTANTIATE_TEST_SUITE_P(DtypesAndWriteMethods, SeedScale,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f32),
                                            ::testing::Values(IoMethod::raw, IoMethod::hyperslab)),
                         [](const auto& info) {
                           return cat(dtype_name(std::get<0>(info.param)), "_",
                                      std::get<1>(info.param) == IoMethod::raw ? "raw" : "hyperslab");
                         });

TEST_P(SeedScale, FullPartlyPaddedAndPaddingOnlyRanksRoundTripOnTheGlobalPath) {
  ScratchDir dir;
  save_global(dir / "seed.h5");
  // Every element of every dataset is the saved one: the blocks at their plain-TP global shapes.
  const CheckpointReader reader(dir / "seed.h5");
  ASSERT_EQ(reader.datasets().size(), 5u);
  const auto read_all = [&](const std::string& key, std::vector<std::int64_t> shape) {
    const Dataset& d = reader.dataset(key);
    EXPECT_EQ(d.shape, shape) << key;
    EXPECT_EQ(d.dtype, dtype()) << key;
    HostBuffer all = HostBuffer::zeros(dtype(), Extents(std::span<const std::int64_t>(shape)));
    reader.read(d, std::vector<std::int64_t>(shape.size(), 0), shape, all.mut_view(), {method()});
    return all;
  };
  const HostBuffer x = read_all("mixer.in_proj.weight.x", {40'000, 2});
  const HostBuffer b = read_all("mixer.in_proj.weight.B", {21'760, 2});
  for (std::int64_t r = 0; r < 61'760; ++r)
    for (int c = 0; c < 2; ++c)
      ASSERT_EQ(r < 40'000 ? get(x.view(), static_cast<std::size_t>(r * 2 + c))
                           : get(b.view(), static_cast<std::size_t>((r - 40'000) * 2 + c)),
                fused_code(r, c))
          << "row " << r;
  std::int64_t first = 0;
  for (const Section& s : split.sections) {
    const HostBuffer block = read_all(block_key(split.key, s.name), {s.rows * G, 2});
    for (int g = 0; g < G; ++g)
      for (std::int64_t r = 0; r < s.rows; ++r)
        for (int c = 0; c < 2; ++c)
          ASSERT_EQ(get(block.view(), static_cast<std::size_t>((g * s.rows + r) * 2 + c)), split_code(g, first + r, c))
              << s.name << " rank " << g;
    first += s.rows;
  }
  // Loads of full, partly padded and padding-only ranks, into memory the load allocates and into
  // poisoned destinations.
  for (int g : {0, 1, 40, 61, 62, 63}) check(g, load(dir / "seed.h5", request(g), {method()}));
  for (int g : {0, 62, 63}) {
    std::vector<SharedBuffer> keep;
    StateDict dst = poisoned(g, keep);
    const Values v = load_into(dir / "seed.h5", dst, {method()});
    check(g, dst, v);
  }
}

TEST_P(SeedScale, FullPartlyPaddedAndPaddingOnlyRanksRoundTripOnTheLocalPath) {
  ScratchDir dir;
  for (int g : {0, 40, 61, 62, 63}) {
    const Rank r = build(g);
    const auto file = dir / ("rank" + std::to_string(g) + ".h5");
    save_local(r.state, file, method());
    check(g, load_local(file, request(g), {method()}));
    std::vector<SharedBuffer> keep;
    StateDict dst = poisoned(g, keep);
    const Values v = load_local_into(file, dst, {method()});
    check(g, dst, v);
  }
  // A local checkpoint only loads at the layout that wrote it.
  StateDict other;
  other.add(ShardedParam{fused, G, 32, {0, 61}, dtype()});
  EXPECT_EQ(error_of([&] { (void)load_local(dir / "rank0.h5", other); }).code(), Errc::missing_key);
}

// The padding-only rank's parameter never reaches a file; a load rebuilds its placeholder from the
// request as a local value and merges every factory against the complete tree (loaded pieces,
// common values, local values). Merging before the local values are in the tree finds no key for
// the padding-only rank (the peer system's "Different dict keys encountered"), on either path.
TEST_P(SeedScale, PaddingOnlyRankIsRebuiltFromTheRequestAndMergedAgainstTheCompleteTree) {
  ScratchDir dir;
  const Rank r = build(63);
  save_local(r.state, dir / "rank63.h5", method());
  const CheckpointReader local(dir / "rank63.h5");
  EXPECT_EQ(error_of([&] { (void)local.dataset(fused.key); }).code(), Errc::missing_key);
  for (const Dataset& d : local.datasets()) {
    EXPECT_FALSE(d.key.starts_with(fused.key)) << d.key;
    ASSERT_TRUE(d.placement.has_value()) << d.key;
    EXPECT_FALSE(d.placement->key.starts_with(fused.key)) << d.key;
  }
  EXPECT_EQ(local.datasets().size(), 3u);  // the split factory's blocks alone
  save_global(dir / "seed.h5");

  for (const bool local_path : {true, false}) {
    SCOPED_TRACE(local_path ? "local path" : "global path");
    const auto file = dir / (local_path ? "rank63.h5" : "seed.h5");
    const auto load_at = [&](const StateDict& request) {
      return local_path ? load_local(file, request, {method()}) : load(file, request, {method()});
    };
    const auto load_into_at = [&](StateDict& state) {
      return local_path ? load_local_into(file, state, {method()}) : load_into(file, state, {method()});
    };
    try {
      // Nothing but the padding-only parameter: its key exists only as the placeholder.
      const LoadedState alone = load_at(request(63, false));
      check_fused(63, alone.tensor(fused.key).view());
      EXPECT_EQ(std::get<std::int64_t>(alone.value("rng")), 1063);
      // With the other factory, into memory the load allocates and into poisoned destinations.
      check(63, load_at(request(63)));
      std::vector<SharedBuffer> keep;
      StateDict dst = poisoned(63, keep);
      check(63, dst, load_into_at(dst));
    } catch (const Error& e) {  // reported for each path
      ADD_FAILURE() << errc_name(e.code()) << ": " << e.what();
    }
  }
}
