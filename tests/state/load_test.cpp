// Tests for shardckpt.state: loads at any layout and write method, what a load allocates, how it
// reads, the destinations it refuses, and state dict keys.
#include "support.hpp"

// A load allocates its destination shards and nothing else; a load into existing destinations
// allocates nothing at all (BufferStats counts every HostBuffer, SharedBuffer and engine buffer).
TEST(Load, AllocatesOnlyTheDestinationsAndLoadIntoAllocatesNothing) {
  ScratchDir dir;
  const auto c = small_model();
  const demo::Training adam{.adam = true, .distributed = true};
  const demo::Layout saved{2, 2, 8, 1}, l{1, 4, 16, 2};
  run_ranks(saved.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, saved, g.rank(), adam);
    save(m.state, dir / "a.h5", g);
    save_local(m.state, dir / ("local" + std::to_string(g.rank()) + ".h5"));
  });
  bool padding_only = false;
  for (int r = 0; r < l.ranks(); ++r) {
    SCOPED_TRACE(cat("rank ", r));
    StateDict request = demo::request(c, l, r, adam);
    std::uint64_t tensors = 0, bytes = 0;
    for (const ShardedParam& p : request.params()) {
      const std::uint64_t b = static_cast<std::uint64_t>(p.shard_shape().elements()) * dtype_size(p.dtype);
      ASSERT_GT(b, 0u) << p.spec.key;  // empty buffers are not allocations: keep every shard non-empty
      ++tensors;
      bytes += b;
      padding_only = padding_only || plan_rank(p.spec, p.gtp, p.align, p.coord).padding_only;
    }
    BufferStats before = buffer_stats();
    {
      const LoadedState s = load(dir / "a.h5", request);
      const BufferStats after = buffer_stats();
      EXPECT_EQ(after.allocations - before.allocations, tensors);
      EXPECT_EQ(after.bytes - before.bytes, bytes);
      EXPECT_EQ(demo::verify(c, adam, r, request, s).mismatches, 0);
    }
    StateDict dst = demo::with_destinations(request);
    before = buffer_stats();
    const Values v = load_into(dir / "a.h5", dst);
    EXPECT_EQ(buffer_stats().allocations, before.allocations);
    EXPECT_EQ(buffer_stats().bytes, before.bytes);
    const demo::Verification check = demo::verify(c, adam, r, dst, v);
    EXPECT_EQ(check.mismatches, 0) << check.first_mismatch;
    EXPECT_GT(check.values, 0);
  }
  EXPECT_TRUE(padding_only);
  // The local path at the saving layout: the same.
  for (int r = 0; r < saved.ranks(); ++r) {
    StateDict dst = demo::with_destinations(demo::request(c, saved, r, adam));
    const BufferStats before = buffer_stats();
    const Values v = load_local_into(dir / ("local" + std::to_string(r) + ".h5"), dst);
    EXPECT_EQ(buffer_stats().allocations, before.allocations) << r;
    EXPECT_EQ(buffer_stats().bytes, before.bytes) << r;
    EXPECT_EQ(demo::verify(c, adam, r, dst, v).mismatches, 0) << r;
  }
}

TEST(Load, SaveAtGtp2LoadAtGtp1AndTheReverse) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {1, 2, 16, 1}, dir / "g2.h5");
  EXPECT_EQ(load_mismatches(c, {1, 1, 0, 1}, dir / "g2.h5"), 0);
  save_model(c, {1, 1, 0, 1}, dir / "g1.h5");
  EXPECT_EQ(load_mismatches(c, {1, 2, 16, 1}, dir / "g1.h5"), 0);
}

TEST(Load, PlainTpAndGatherSavedCheckpointsLoadAtAnyGtpAndTp2ToTp1KeepsBlockOrder) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {2, 1, 0, 1}, dir / "plain.h5");
  const demo::Layout old_layout{2, 2, 8, 1};
  std::vector<demo::RankModel> models;
  for (int r = 0; r < old_layout.ranks(); ++r) models.push_back(demo::build_rank(c, old_layout, r));
  const std::int64_t gathered = demo::gather_save(c, old_layout, models, dir / "gather.h5");
  EXPECT_GT(gathered, 0);
  for (const auto& file : {dir / "plain.h5", dir / "gather.h5"}) {
    EXPECT_EQ(load_mismatches(c, {2, 4, 8, 1}, file), 0) << file;
    EXPECT_EQ(load_mismatches(c, {1, 3, 16, 1}, file), 0) << file;  // TP 2 -> TP 1
  }
}

TEST(Load, HyperslabAndRawPathsAgree) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {2, 2, 8, 1}, dir / "d.h5", IoMethod::raw);
  save_model(c, {2, 2, 8, 1}, dir / "h.h5", IoMethod::hyperslab);
  const demo::Layout l{1, 2, 4, 1};
  for (int r = 0; r < l.ranks(); ++r) {
    const LoadedState a = load(dir / "d.h5", demo::request(c, l, r), {IoMethod::hyperslab});
    const LoadedState b = load(dir / "h.h5", demo::request(c, l, r), {IoMethod::raw});
    for (const ParamSpec& p : demo::params(c, l.tp)) {
      const SharedBuffer& x = a.tensor(p.key);
      const SharedBuffer& y = b.tensor(p.key);
      ASSERT_EQ(x.bytes(), y.bytes());
      EXPECT_EQ(std::memcmp(x.view().data(), y.view().data(), x.bytes()), 0) << p.key;
    }
  }
}

TEST(Load, MambaInProjAndConv1dTakeTheGatherFreePath) {
  ScratchDir dir;
  demo::ModelConfig c = small_model();
  c.gdp_layers = 0;
  c.mamba_layers = 2;
  const auto before = materialization_count();
  save_model(c, {2, 2, 8, 1}, dir / "m.h5");
  EXPECT_EQ(materialization_count(), before);
  const CheckpointReader r(dir / "m.h5");
  EXPECT_NO_THROW((void)r.dataset("decoder.layers.1.mixer.in_proj.weight.dt"));
  EXPECT_NO_THROW((void)r.dataset("decoder.layers.1.mixer.conv1d.weight.C"));
  EXPECT_EQ(load_mismatches(c, {1, 4, 4, 1}, dir / "m.h5"), 0);
}

TEST(StateDicts, KeysAreUniqueAcrossKinds) {
  StateDict s;
  s.add_common("k", std::int64_t{1});
  EXPECT_EQ(error_of([&] { s.add_local("k", std::int64_t{2}); }).code(), Errc::invalid_argument);
  EXPECT_EQ(
      error_of([&] {
        s.add(ShardedParam{ParamSpec{"p", plain_sections(4), {}, TpAxis::rows, 1, {}}, 2, 0, {0, 2}, DType::f32});
      }).code(),
      Errc::invalid_argument);  // GTP rank 2 of a group of 2
}

// Loads read tensor data through the page cache unless asked to read around it, and either way
// deliver the same values.
TEST(Load, ReadsAroundThePageCacheOnlyWhenAskedTo) {
  ScratchDir dir;
  demo::ModelConfig c;
  c.cols = 1024;
  const demo::Layout l{1, 2, 8, 1};
  run_ranks(l.ranks(), [&](ProcessGroup& g) { save(demo::build_rank(c, l, g.rank()).state, dir / "a.h5", g); });
  if (!testing_support::direct_io_possible(dir / "a.h5")) GTEST_SKIP() << "this file system refuses O_DIRECT";
  const std::size_t pages = (std::filesystem::file_size(dir / "a.h5") + 4095) / 4096;
  ASSERT_GT(pages, 1000u);  // tensor data, not metadata, makes up the file
  StateDict request = demo::request(c, l, 0), model = demo::with_destinations(request);
  const auto check = [&](const demo::Verification& v) {
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    EXPECT_GT(v.values, 0);
  };
  // Rank 0 reads half of the file's tensor bytes.
  for (const bool bypass : {false, true}) {
    SCOPED_TRACE(bypass ? "around the page cache" : "through the page cache");
    const LoadOptions options{.bypass_page_cache = bypass};
    const auto expect_cached = [&](std::size_t cached) {
      if (bypass)
        EXPECT_LT(cached, pages / 4) << "of " << pages;
      else
        EXPECT_GT(cached, pages / 3) << "of " << pages;
    };
    expect_cached(testing_support::cached_pages_after(dir / "a.h5", [&] {
      check(demo::verify(c, {}, 0, model, load_into(dir / "a.h5", model, options)));
    }));
    expect_cached(testing_support::cached_pages_after(dir / "a.h5", [&] {
      check(demo::verify(c, {}, 0, request, load(dir / "a.h5", request, options)));
    }));
  }
}

// A load checks every destination before it reads a byte: a read-only entry, or two entries whose
// memory overlaps, is a typed error naming the keys, and nothing is loaded into the others.
TEST(Load, ReadOnlyOrOverlappingDestinationsAreRefusedBeforeAnyRead) {
  ScratchDir dir;
  {
    StateDict s;
    SharedBuffer a = SharedBuffer::zeros(DType::f32, {4, 2}), b = SharedBuffer::zeros(DType::f32, {4, 2});
    for (float& x : a.mut_view().as<float>()) x = 1;
    for (float& x : b.mut_view().as<float>()) x = 2;
    s.add(ShardedTensor::of("a", a, {4, 2}, {0, 0}));
    s.add(ShardedTensor::of("b", b, {4, 2}, {0, 0}));
    save(s, dir / "c.h5");
  }
  SharedBuffer first = SharedBuffer::zeros(DType::f32, {4, 2});
  const SharedBuffer second = SharedBuffer::zeros(DType::f32, {4, 2});
  StateDict read_only;
  read_only.add(ShardedTensor::of("a", first, {4, 2}, {0, 0}));
  read_only.add(ShardedTensor::of("b", TensorRef::read_only(second), {4, 2}, {0, 0}));
  const Error e = error_of([&] { (void)load_into(dir / "c.h5", read_only); });
  EXPECT_EQ(e.code(), Errc::invalid_argument);
  EXPECT_TRUE(testing_support::contains(e.what(), "tensor b")) << e.what();
  for (float x : first.view().as<float>()) EXPECT_EQ(x, 0.0f);  // not even `a` was read
  // Two entries over the same memory (the second half of one is the first half of the other).
  std::vector<float> memory(12, -1);
  StateDict overlapping;
  overlapping.add(ShardedTensor::of(
      "a", unchecked_borrow(MutTensorView::unchecked(memory.data(), DType::f32, {4, 2})), {4, 2}, {0, 0}));
  overlapping.add(ShardedTensor::of(
      "b", unchecked_borrow(MutTensorView::unchecked(memory.data() + 4, DType::f32, {4, 2})), {4, 2}, {0, 0}));
  const Error o = error_of([&] { (void)load_into(dir / "c.h5", overlapping); });
  EXPECT_EQ(o.code(), Errc::invalid_argument);
  EXPECT_TRUE(testing_support::contains(o.what(), "destinations of a and b share 16 bytes")) << o.what();
  EXPECT_EQ(memory, std::vector<float>(12, -1));
}

// A checkpoint's records know its model. TP 8 divides every block's rows of tiny_model but not its 4
// groups: a load there is refused before anything is read, with the message validate and spec_at_tp
// give, whether the request comes from the records, from the model, or from sections computed
// without divisors (the records refuse those).
TEST(Load, AtATpThatDoesNotDivideTheGroupsIsRefusedWithOneMessage) {
  ScratchDir dir;
  const demo::ModelConfig c = testing_support::tiny_model();
  save_model(c, {2, 2, 16, 1}, dir / "m.h5");
  const CheckpointReader reader(dir / "m.h5");
  const ParamRecord& first = reader.contents().params.front();
  ASSERT_EQ(first.divisors, ssm_divisors(c.dims));
  const std::string message = cat(first.key, ": groups (4) does not divide by TP 8");
  const auto refusal = [](auto&& fn) {
    const Error e = error_of(fn);
    EXPECT_EQ(e.code(), Errc::layout) << e.what();
    return std::string(e.what());
  };
  EXPECT_EQ(refusal([&] { (void)request_all(reader, {8, 1, 0, {0, 0}, 0, 1, false}); }), message);
  EXPECT_EQ(refusal([&] { (void)spec_at_tp(first, 8); }), message);
  ParamSpec at_8 = spec_at_tp(first, 4);
  at_8.tp = 8;
  EXPECT_EQ(refusal([&] { validate(at_8); }), message);
  EXPECT_EQ(refusal([&] { (void)demo::request(c, {8, 1, 0, 1}, 0); }),
            "decoder.layers.0.mixer.in_proj.weight: groups (4) does not divide by TP 8");
  StateDict request;
  for (ParamRecord r : reader.contents().params) {
    r.divisors.clear();
    const DType dtype = reader.dataset(block_key(r.key, r.blocks.front().name)).dtype;
    request.add(ShardedParam{spec_at_tp(r, 8), 1, 0, {0, 0}, dtype});
  }
  EXPECT_EQ(refusal([&] { (void)load(dir / "m.h5", request); }), message);
  StateDict dst = demo::with_destinations(request);
  EXPECT_EQ(refusal([&] { (void)load_into(dir / "m.h5", dst); }), message);
  // At TP 4 the same checkpoint loads.
  EXPECT_EQ(load_mismatches(c, {4, 1, 0, 1}, dir / "m.h5"), 0);
}
