// Tests for shardckpt.state: loads at any layout and write method, what a load allocates, how it
// reads, the destinations it refuses, state dict keys, and scalars (0-d tensors) saved and loaded.
#include "support.hpp"

// A load allocates its destination shards (those it does not map) and nothing else; a load into
// existing destinations allocates nothing at all (BufferStats counts every HostBuffer, SharedBuffer and engine buffer).
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
      const LoadedState s = load(dir / "a.h5", request, {.map = false});  // map_test.cpp: what is mapped
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
// deliver the same values. HDF5's metadata is read through the page cache, and the kernel reads
// ahead of it (on this project's machines about 1.4 MiB past the metadata at the start of the file):
// the file is large enough that this is a small part of it.
TEST(Load, ReadsAroundThePageCacheOnlyWhenAskedTo) {
  ScratchDir dir;
  demo::ModelConfig c;
  c.cols = 4096;
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

// ---- scalars (0-d tensors: global shape [], one element) ------------------------------------------

namespace {

// A state dict of two scalars and a [3] tensor, with values no other bytes of a file hold.
constexpr std::int64_t scalar_i64 = 0x1122334455667788;
constexpr float scalar_f32 = 0.5f;
const float scalar_bf16 = to_f32(to_bf16(-3.25f));

SharedBuffer one(DType dtype) { return SharedBuffer::zeros(dtype, {1}); }

StateDict scalar_state(SharedBuffer& a, SharedBuffer& b, SharedBuffer& c, SharedBuffer& v) {
  a.mut_view().as<std::int64_t>()[0] = scalar_i64;
  b.mut_view().as<float>()[0] = scalar_f32;
  c.mut_view().as<bf16>()[0] = to_bf16(scalar_bf16);
  for (std::int64_t& x : v.mut_view().as<std::int64_t>()) x = 7;
  StateDict s;
  s.add(ShardedTensor::of("bn.num_batches_tracked", a, {}, {}));
  s.add(ShardedTensor::of("opt.step", b, {}, {}));
  s.add(ShardedTensor::expect("half", DType::bf16, {}, {}, {}));  // expect's Extents{} is a scalar's [1]
  s.mut_data(s.tensors().size() - 1) = c;
  s.add(ShardedTensor::of("v", v, {3}, {0}));
  return s;
}

StateDict scalar_request() {
  StateDict r;
  r.add(ShardedTensor::expect("bn.num_batches_tracked", DType::i64, {}, {}, {}));
  r.add(ShardedTensor::expect("opt.step", DType::f32, {1}, {}, {}));  // [1] or [] for the one element
  r.add(ShardedTensor::expect("half", DType::bf16, {}, {}, {}));
  return r;
}

StateDict scalar_request_of(const std::string& key) {
  StateDict r;
  r.add(ShardedTensor::expect(key, DType::i64, {}, {}, {}));
  return r;
}

void expect_scalar_values(const LoadedState& s) {
  EXPECT_EQ(s.tensor("bn.num_batches_tracked").shape(), Extents{1});
  EXPECT_EQ(s.tensor("bn.num_batches_tracked").view().as<std::int64_t>()[0], scalar_i64);
  EXPECT_EQ(s.tensor("opt.step").view().as<float>()[0], scalar_f32);
  EXPECT_EQ(to_f32(s.tensor("half").view().as<bf16>()[0]), scalar_bf16);
}

}  // namespace

// A scalar is a dataset of scalar dataspace (h5py reads shape ()), checksummed as one row of one
// element, written and read by address and through HDF5 alike, and loaded into one element.
TEST(Scalars, SaveAsScalarDatasetsAndLoadBackThroughEitherMethod) {
  ScratchDir dir;
  for (IoMethod saved : {IoMethod::raw, IoMethod::hyperslab}) {
    SCOPED_TRACE(saved == IoMethod::raw ? "saved raw" : "saved through hyperslabs");
    const auto path = dir / (saved == IoMethod::raw ? "raw.h5" : "hyperslab.h5");
    SharedBuffer a = one(DType::i64), b = one(DType::f32), c = one(DType::bf16),
                 v = SharedBuffer::zeros(DType::i64, {3});
    save(scalar_state(a, b, c, v), path, {saved});
    const CheckpointReader reader(path);
    ASSERT_EQ(reader.datasets().size(), 4u);
    EXPECT_TRUE(reader.skipped().empty());
    for (const char* key : {"bn.num_batches_tracked", "opt.step", "half"}) {
      EXPECT_TRUE(reader.dataset(key).shape.empty()) << key;
      const std::vector<Slab> slabs = reader.slabs(reader.dataset(key));
      ASSERT_EQ(slabs.size(), 1u) << key;
      EXPECT_EQ(slabs[0].box, (Box{{0, 1}, {0, 1}})) << key;
    }
    EXPECT_EQ(reader.dataset("opt.step").dtype, DType::f32);
    const VerifyReport report = verify_checkpoint(reader);
    EXPECT_EQ(report.mismatches, 0);
    EXPECT_EQ(report.checksum_rows, 3 + 3);  // a row per scalar, 3 rows of v
    EXPECT_EQ(report.bytes, 8 + 4 + 2 + 24);
    for (IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
      expect_scalar_values(load(path, scalar_request(), {method}));
      // Into memory of one's own: one element each.
      SharedBuffer x = one(DType::i64), y = one(DType::f32), z = one(DType::bf16);
      StateDict into;
      into.add(ShardedTensor::of("bn.num_batches_tracked", x, {}, {}));
      into.add(ShardedTensor::of("opt.step", y, {}, {}));
      into.add(ShardedTensor::of("half", z, {}, {}));
      (void)load_into(path, into, {method});
      EXPECT_EQ(x.view().as<std::int64_t>()[0], scalar_i64);
      EXPECT_EQ(y.view().as<float>()[0], scalar_f32);
      EXPECT_EQ(to_f32(z.view().as<bf16>()[0]), scalar_bf16);
    }
    if (testing_support::have_python_module("h5py")) {
      EXPECT_EQ(testing_support::run_python("import h5py, sys\nf = h5py.File(sys.argv[1], 'r')\n"
                                            "assert f['opt.step'].shape == () and f['opt.step'][()] == 0.5\n"
                                            "assert f['half'].shape == () and f['half'][()] == -3.25\n"
                                            "n = f['bn.num_batches_tracked']\n"
                                            "assert n.shape == () and n.dtype == 'int64'\n"
                                            "assert n[()] == 0x1122334455667788\n"
                                            "assert f['v'].shape == (3,)\n",
                                            path.string()),
                0);
    }
  }
  // The local (per-rank) path holds the scalar's one element and its empty global shape.
  SharedBuffer a = one(DType::i64), b = one(DType::f32), c = one(DType::bf16), v = SharedBuffer::zeros(DType::i64, {3});
  save_local(scalar_state(a, b, c, v), dir / "local.h5");
  expect_scalar_values(load_local(dir / "local.h5", scalar_request()));
}

// A byte of a scalar changed in the file is found by verify and refused by a load, as any row is.
TEST(Scalars, AreVerifiedAgainstTheirChecksum) {
  ScratchDir dir;
  SharedBuffer a = one(DType::i64), b = one(DType::f32), c = one(DType::bf16), v = SharedBuffer::zeros(DType::i64, {3});
  save(scalar_state(a, b, c, v), dir / "c.h5");
  std::string bytes = file_bytes(dir / "c.h5");
  std::string pattern(8, '\0');
  std::memcpy(pattern.data(), &scalar_i64, 8);
  const std::size_t at = bytes.find(pattern);
  ASSERT_NE(at, std::string::npos);
  ASSERT_EQ(bytes.find(pattern, at + 1), std::string::npos);
  bytes[at] ^= 1;
  std::ofstream(dir / "c.h5", std::ios::binary | std::ios::trunc) << bytes;
  const VerifyReport report = verify_checkpoint(CheckpointReader(dir / "c.h5"));
  EXPECT_EQ(report.mismatches, 1);
  ASSERT_EQ(report.problems.size(), 1u);
  EXPECT_TRUE(testing_support::contains(report.problems[0], "key bn.num_batches_tracked, rows [0, 1)"))
      << report.problems[0];
  for (IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
    const Error e = error_of([&] { (void)load(dir / "c.h5", scalar_request(), {method}); });
    EXPECT_EQ(e.code(), Errc::corrupt) << e.what();
    EXPECT_TRUE(testing_support::contains(e.what(), "bn.num_batches_tracked")) << e.what();
  }
}

// Data-parallel copies of a scalar on thread ranks: exactly one writes it (replica 0's value is in
// the file), copies that do not say they are replicas are an overlap, and copies that load through
// their replica group each end with the value.
TEST(Scalars, OneOfTheReplicasWritesAndEveryReplicaLoads) {
  ScratchDir dir;
  for (IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
    run_ranks(4, [&](ProcessGroup& g) {
      SharedBuffer s = one(DType::i64);
      s.mut_view().as<std::int64_t>()[0] = 100 + g.rank();  // told apart, to see whose is written
      StateDict state;
      state.add(ShardedTensor::of("step", s, {}, {}, g.rank(), g.size()));
      save(state, dir / "c.h5", g, {method});
    });
    const CheckpointReader reader(dir / "c.h5");
    EXPECT_EQ(reader.slabs(reader.dataset("step")).size(), 1u);
    const LoadedState loaded = load(reader, scalar_request_of("step"));
    EXPECT_EQ(loaded.tensor("step").view().as<std::int64_t>()[0], 100);
  }
  std::vector<std::string> messages;
  std::mutex m;
  run_ranks(2, [&](ProcessGroup& g) {
    SharedBuffer s = one(DType::i64);
    StateDict state;
    state.add(ShardedTensor::of("step", s, {}, {}));  // both write it
    const Error e = error_of([&] { save(state, dir / "overlap.h5", g); });
    const std::lock_guard lock(m);
    EXPECT_EQ(e.code(), Errc::tiling);
    messages.push_back(e.what());
  });
  for (const std::string& text : messages)
    EXPECT_TRUE(testing_support::contains(text, "key step: rows [0, 1) are saved by both rank 0 and rank 1")) << text;
  EXPECT_FALSE(std::filesystem::exists(dir / "overlap.h5"));
  std::vector<std::int64_t> got(4, -1);
  run_ranks(4, [&](ProcessGroup& g) {
    SharedBuffer s = one(DType::i64);
    StateDict into;
    into.add(ShardedTensor::of("step", s, {}, {}, g.rank(), g.size()));
    (void)load_into(dir / "c.h5", into, g, {}, g);  // the group is the replica group: one reads, all receive
    got[static_cast<std::size_t>(g.rank())] = s.view().as<std::int64_t>()[0];
  });
  EXPECT_EQ(got, std::vector<std::int64_t>(4, 100));
}

// A scalar request against a [1] dataset, or a [1] request against a scalar dataset, is
// Errc::shape_mismatch naming the key and both shapes; a scalar with an offset or a shard of more
// than one element is refused when added.
TEST(Scalars, ARequestOfAnotherShapeIsAShapeMismatchNamingBoth) {
  ScratchDir dir;
  {
    SharedBuffer s = one(DType::f32), t = one(DType::f32);
    StateDict state;
    state.add(ShardedTensor::of("scalar", s, {}, {}));
    state.add(ShardedTensor::of("vector", t, {1}, {0}));
    save(state, dir / "c.h5");
  }
  for (IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
    StateDict as_vector;
    as_vector.add(ShardedTensor::expect("scalar", DType::f32, {1}, {1}, {0}));
    const Error a = error_of([&] { (void)load(dir / "c.h5", as_vector, {method}); });
    EXPECT_EQ(a.code(), Errc::shape_mismatch) << a.what();
    EXPECT_TRUE(testing_support::contains(a.what(), "key scalar: the checkpoint holds global shape [] but tensor "
                                                    "scalar expects [1]"))
        << a.what();
    StateDict as_scalar;
    as_scalar.add(ShardedTensor::expect("vector", DType::f32, {}, {}, {}));
    const Error b = error_of([&] { (void)load(dir / "c.h5", as_scalar, {method}); });
    EXPECT_EQ(b.code(), Errc::shape_mismatch) << b.what();
    EXPECT_TRUE(testing_support::contains(b.what(), "key vector: the checkpoint holds global shape [1] but tensor "
                                                    "vector expects []"))
        << b.what();
  }
  SharedBuffer two = SharedBuffer::zeros(DType::f32, {2});
  StateDict bad;
  const Error offset = error_of([&] { bad.add(ShardedTensor::expect("s", DType::f32, {}, {}, {0})); });
  EXPECT_EQ(offset.code(), Errc::invalid_argument);
  EXPECT_TRUE(testing_support::contains(offset.what(), "tensor s: a scalar (global shape [])")) << offset.what();
  EXPECT_EQ(error_of([&] { bad.add(ShardedTensor::of("s", two, {}, {})); }).code(), Errc::invalid_argument);
  EXPECT_EQ(bad.tensors().size(), 0u);
}

// Several parts of one key on one rank (the layers of a layer-stacked weight), split past dim 1 (by
// TP on its last dim): saved into one dataset at its global shape, loaded at another split, through
// either method; a load into new memory refuses a key twice, and parts of one key must agree.
TEST(StateDicts, PartsOfOneKeySplitPastDim1SaveIntoOneDatasetAndLoadAtAnotherSplit) {
  ScratchDir dir;
  const std::int64_t L = 3, h = 4, f = 6;
  const auto value = [&](std::int64_t l, std::int64_t a, std::int64_t c) { return static_cast<float>((l * h + a) * f + c); };
  std::vector<SharedBuffer> parts;
  StateDict state;
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t c0 : {0, 3}) {
      SharedBuffer b = SharedBuffer::zeros(DType::f32, {1, h, 3});
      auto v = b.mut_view().as<float>();
      for (std::int64_t a = 0; a < h; ++a)
        for (std::int64_t c = 0; c < 3; ++c) v[static_cast<std::size_t>(a * 3 + c)] = value(l, a, c0 + c);
      state.add(ShardedTensor::of("w", b, {L, h, f}, {l, 0, c0}));
      parts.push_back(std::move(b));
    }
  for (IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
    const auto path = dir / (method == IoMethod::raw ? "raw.h5" : "hyperslab.h5");
    save(state, path, {method});
    const CheckpointReader reader(path);
    EXPECT_EQ(reader.dataset("w").shape, (std::vector<std::int64_t>{L, h, f}));
    EXPECT_EQ(verify_checkpoint(reader).mismatches, 0);
    StateDict into;
    std::vector<SharedBuffer> got;
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t c0 : {0, 2, 4}) {
        got.push_back(SharedBuffer::zeros(DType::f32, {1, h, 2}));
        into.add(ShardedTensor::of("w", got.back(), {L, h, f}, {l, 0, c0}));
      }
    (void)load_into(path, into, {method});
    std::size_t n = 0;
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t c0 : {0, 2, 4}) {
        const auto v = got[n++].view().as<float>();
        for (std::int64_t a = 0; a < h; ++a)
          for (std::int64_t c = 0; c < 2; ++c)
            EXPECT_EQ(v[static_cast<std::size_t>(a * 2 + c)], value(l, a, c0 + c)) << l << " " << a << " " << c0 + c;
      }
    EXPECT_EQ(error_of([&] { (void)load(path, into, {method}); }).code(), Errc::invalid_argument);
  }
  // A part of another global shape or dtype under the same key is refused when added.
  EXPECT_EQ(error_of([&] { state.add(ShardedTensor::of("w", parts[0], {L, h, f + 1}, {0, 0, 0})); }).code(),
            Errc::invalid_argument);
  state.add_common("c", std::int64_t{1});
  EXPECT_EQ(error_of([&] { state.add(ShardedTensor::of("c", parts[0], {L, h, f}, {0, 0, 0})); }).code(),
            Errc::invalid_argument);
}
