// Tests for the C API (include/shardckpt/shardckpt.h), compiled as C++17 with no module flags, as a
// framework's extension would use it: GTP shards saved by thread ranks and loaded at another layout,
// and every failure as a code and a message that names what was wrong.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <shardckpt/shardckpt.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

namespace fs = std::filesystem;

// A fused weight [z | V0 V1 | b] of 30 rows and 4 columns, f32.
const shardckpt_section sections[] = {{"z", 8}, {"V0", 8}, {"V1", 8}, {"b", 6}};
const std::int64_t trailing[] = {4};
constexpr std::int64_t rows = 30, cols = 4;

shardckpt_param weight(std::int64_t gtp, std::int64_t gtp_rank, std::int64_t align) {
  shardckpt_param p{};
  p.key = "layers.0.in_proj.weight";
  p.sections = sections;
  p.section_count = 4;
  p.trailing = trailing;
  p.trailing_count = 1;
  p.tp_axis = SHARDCKPT_TP_ROWS;
  p.tp = 1;
  p.gtp = gtp;
  p.gtp_rank = gtp_rank;
  p.align = align;
  p.dtype = SHARDCKPT_F32;
  return p;
}

std::int64_t padded_rows(const shardckpt_param& p) {
  std::int64_t padded = -1;
  EXPECT_EQ(shardckpt_shard_rows(&p, &padded, nullptr), SHARDCKPT_OK) << shardckpt_last_error();
  return padded;
}

// Value of element (row, col) of the whole weight.
float value(std::int64_t row, std::int64_t col) { return static_cast<float>(row * 100 + col); }

struct Rank {
  std::vector<float> shard;
  shardckpt_state* state = shardckpt_state_new();
  Rank() = default;
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  ~Rank() { shardckpt_state_free(state); }
};

// Each GTP rank's padded shard of the weight (real rows filled, pad rows `pad`), in its state dict.
std::vector<Rank> ranks_at(std::int64_t gtp, std::int64_t align, bool fill, float pad = 0) {
  std::vector<Rank> out(static_cast<std::size_t>(gtp));
  for (std::int64_t g = 0; g < gtp; ++g) {
    shardckpt_param p = weight(gtp, g, align);
    const std::int64_t l = padded_rows(p);
    Rank& r = out[static_cast<std::size_t>(g)];
    r.shard.assign(static_cast<std::size_t>(l * cols), pad);
    for (std::int64_t i = 0; fill && i < l && g * l + i < rows; ++i)
      for (std::int64_t c = 0; c < cols; ++c) r.shard[static_cast<std::size_t>(i * cols + c)] = value(g * l + i, c);
    p.shard = r.shard.data();
    p.shard_bytes = r.shard.size() * sizeof(float);
    EXPECT_EQ(shardckpt_state_add_param(r.state, &p), SHARDCKPT_OK) << shardckpt_last_error();
  }
  return out;
}

std::vector<shardckpt_state*> states_of(std::vector<Rank>& ranks) {
  std::vector<shardckpt_state*> out;
  for (Rank& r : ranks) out.push_back(r.state);
  return out;
}

class CApi : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardckpt_capi_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const char* name) const { return (dir_ / name).string(); }

  // Saves the weight from `gtp` thread ranks at alignment `align`, with three common values.
  std::string save(std::int64_t gtp, std::int64_t align) {
    std::vector<Rank> ranks = ranks_at(gtp, align, true);
    for (Rank& r : ranks) {
      EXPECT_EQ(shardckpt_state_add_int(r.state, "step", 1000), SHARDCKPT_OK);
      EXPECT_EQ(shardckpt_state_add_double(r.state, "lr", 0.25), SHARDCKPT_OK);
      EXPECT_EQ(shardckpt_state_add_string(r.state, "arch", "gdp"), SHARDCKPT_OK);
    }
    const std::string to = path("saved.h5");
    std::vector<shardckpt_state*> states = states_of(ranks);
    EXPECT_EQ(shardckpt_save_ranks(states.data(), static_cast<int>(gtp), to.c_str()), SHARDCKPT_OK)
        << shardckpt_last_error();
    return to;
  }

 private:
  fs::path dir_;
};

TEST_F(CApi, ShardRowsFollowTheGeometry) {
  std::int64_t padded = 0, real = 0;
  shardckpt_param p = weight(4, 3, 4);  // 30 rows, block 16: 2 pad rows, 8 rows a shard
  ASSERT_EQ(shardckpt_shard_rows(&p, &padded, &real), SHARDCKPT_OK);
  EXPECT_EQ(padded, 8);
  EXPECT_EQ(real, 6);
}

TEST_F(CApi, GtpShardsSavedByRanksLoadAtAnotherLayout) {
  const std::string file = save(2, 16);  // 16 rows a shard: rank 1 holds 14 real rows, 2 pad rows
  std::vector<Rank> ranks = ranks_at(3, 4, false, -1.0f);  // 12 rows a shard; pads start as -1
  std::vector<shardckpt_state*> states = states_of(ranks);
  shardckpt_values* values = nullptr;
  ASSERT_EQ(shardckpt_load_into_ranks(file.c_str(), states.data(), 3, &values), SHARDCKPT_OK) << shardckpt_last_error();
  for (std::int64_t g = 0; g < 3; ++g)
    for (std::int64_t i = 0; i < 12; ++i)
      for (std::int64_t c = 0; c < cols; ++c) {
        const float got = ranks[static_cast<std::size_t>(g)].shard[static_cast<std::size_t>(i * cols + c)];
        EXPECT_EQ(got, g * 12 + i < rows ? value(g * 12 + i, c) : 0.0f) << "rank " << g << " row " << i;
      }
  std::int64_t step = 0;
  double lr = 0;
  const char* arch = nullptr;
  EXPECT_EQ(shardckpt_values_int(values, "step", &step), SHARDCKPT_OK);
  EXPECT_EQ(shardckpt_values_double(values, "lr", &lr), SHARDCKPT_OK);
  EXPECT_EQ(shardckpt_values_string(values, "arch", &arch), SHARDCKPT_OK);
  EXPECT_EQ(step, 1000);
  EXPECT_EQ(lr, 0.25);
  EXPECT_STREQ(arch, "gdp");
  ASSERT_EQ(shardckpt_values_count(values), 3u);
  EXPECT_STREQ(shardckpt_values_key(values, 0), "arch");  // in byte order
  EXPECT_EQ(shardckpt_values_key(values, 3), nullptr);
  shardckpt_value_kind kind{};
  EXPECT_EQ(shardckpt_values_kind(values, "lr", &kind), SHARDCKPT_OK);
  EXPECT_EQ(kind, SHARDCKPT_VALUE_DOUBLE);
  shardckpt_values_free(values);
}

TEST_F(CApi, OneProcessSavesAndLoadsTheWholeWeight) {
  std::vector<Rank> saved = ranks_at(1, 0, true);
  const std::string file = path("one.h5");
  ASSERT_EQ(shardckpt_save(saved[0].state, file.c_str()), SHARDCKPT_OK) << shardckpt_last_error();
  std::vector<Rank> loaded = ranks_at(1, 0, false, 5.0f);
  ASSERT_EQ(shardckpt_load_into(file.c_str(), loaded[0].state, nullptr), SHARDCKPT_OK) << shardckpt_last_error();
  EXPECT_EQ(loaded[0].shard, saved[0].shard);
}

TEST_F(CApi, AWrongSizeBufferIsRefusedWithCodeAndMessage) {
  shardckpt_state* state = shardckpt_state_new();
  std::vector<float> shard(static_cast<std::size_t>(16 * cols));  // the shard has 15 rows at GTP 2
  shardckpt_param p = weight(2, 1, 0);
  p.shard = shard.data();
  p.shard_bytes = shard.size() * sizeof(float);
  EXPECT_EQ(shardckpt_state_add_param(state, &p), SHARDCKPT_ERR_SHAPE_MISMATCH);
  EXPECT_EQ(shardckpt_last_errc(), SHARDCKPT_ERR_SHAPE_MISMATCH);
  const std::string message = shardckpt_last_error();
  EXPECT_NE(message.find("parameter layers.0.in_proj.weight (TP rank 0, GTP rank 1)"), std::string::npos) << message;
  EXPECT_NE(message.find("holds 256 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("f32 [15, 4] needs 240 bytes"), std::string::npos) << message;
  EXPECT_STREQ(shardckpt_errc_name(shardckpt_last_errc()), "shape_mismatch");
  shardckpt_state_free(state);
}

TEST_F(CApi, ALoadIntoAnotherRowWidthIsRefusedBeforeAnyRead) {
  const std::string file = save(2, 16);
  const std::int64_t wider[] = {5};
  shardckpt_param p = weight(1, 0, 0);
  p.trailing = wider;
  std::vector<float> shard(static_cast<std::size_t>(rows * 5), 7.0f);
  p.shard = shard.data();
  p.shard_bytes = shard.size() * sizeof(float);
  shardckpt_state* state = shardckpt_state_new();
  ASSERT_EQ(shardckpt_state_add_param(state, &p), SHARDCKPT_OK) << shardckpt_last_error();
  EXPECT_EQ(shardckpt_load_into(file.c_str(), state, nullptr), SHARDCKPT_ERR_SHAPE_MISMATCH);
  EXPECT_NE(std::string(shardckpt_last_error()).find("layers.0.in_proj.weight.z"), std::string::npos)
      << shardckpt_last_error();
  EXPECT_EQ(shard, std::vector<float>(shard.size(), 7.0f));  // nothing was read into it
  shardckpt_state_free(state);
}

TEST_F(CApi, BadKeysComeBackAsTextAndCode) {
  shardckpt_state* state = shardckpt_state_new();
  std::vector<float> shard(static_cast<std::size_t>(rows * cols));
  shardckpt_param p = weight(1, 0, 0);
  p.shard = shard.data();
  p.shard_bytes = shard.size() * sizeof(float);
  p.key = "layers/0";
  EXPECT_EQ(shardckpt_state_add_param(state, &p), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardckpt_last_error()).find("'layers/0' must be non-empty, contain no '/'"), std::string::npos)
      << shardckpt_last_error();
  p.key = "w";
  EXPECT_EQ(shardckpt_state_add_param(state, &p), SHARDCKPT_OK);
  EXPECT_EQ(shardckpt_state_add_int(state, "w", 1), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(shardckpt_last_error()).find("key w appears twice"), std::string::npos) << shardckpt_last_error();
  p.key = nullptr;
  EXPECT_EQ(shardckpt_state_add_param(state, &p), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(shardckpt_last_error(), "a parameter's key is NULL");
  shardckpt_state_free(state);
}

TEST_F(CApi, AKeyTheCheckpointLacksIsMissing) {
  const std::string file = save(2, 16);
  std::vector<Rank> ranks = ranks_at(1, 0, false);
  std::vector<float> other(8);
  shardckpt_param p = weight(1, 0, 0);
  const shardckpt_section plain[] = {{"", 2}};
  p.key = "layers.0.norm.weight";
  p.sections = plain;
  p.section_count = 1;
  p.shard = other.data();
  p.shard_bytes = other.size() * sizeof(float);
  ASSERT_EQ(shardckpt_state_add_param(ranks[0].state, &p), SHARDCKPT_OK) << shardckpt_last_error();
  EXPECT_EQ(shardckpt_load_into(file.c_str(), ranks[0].state, nullptr), SHARDCKPT_ERR_MISSING_KEY);
  EXPECT_NE(std::string(shardckpt_last_error()).find("layers.0.norm.weight"), std::string::npos)
      << shardckpt_last_error();
}

TEST_F(CApi, LayoutErrorsNameTheNumbers) {
  shardckpt_param p = weight(2, 2, 16);  // GTP rank 2 of 2
  EXPECT_NE(shardckpt_shard_rows(&p, nullptr, nullptr), SHARDCKPT_OK);
  EXPECT_NE(std::string(shardckpt_last_error()).find("2"), std::string::npos);
  p = weight(4, 0, 0);  // 30 rows do not divide by 4 without alignment
  EXPECT_EQ(shardckpt_shard_rows(&p, nullptr, nullptr), SHARDCKPT_ERR_LAYOUT);
  EXPECT_NE(std::string(shardckpt_last_error()).find("30"), std::string::npos) << shardckpt_last_error();
  p = weight(1, 0, 0);
  p.dtype = static_cast<shardckpt_dtype>(99);
  EXPECT_EQ(shardckpt_shard_rows(&p, nullptr, nullptr), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(shardckpt_last_error(), "dtype 99 is not a shardckpt_dtype");
}

// Divisors are the library's: a TP that splits a head is refused with its one message, and a
// checkpoint saved with them refuses such a load too.
TEST_F(CApi, ATpThatSplitsAHeadIsRefusedWithTheOneMessage) {
  const shardckpt_divisor heads[] = {{"heads", 6}};
  shardckpt_param p = weight(1, 0, 0);
  p.divisors = heads;
  p.divisor_count = 1;
  p.tp = 4;
  EXPECT_EQ(shardckpt_shard_rows(&p, nullptr, nullptr), SHARDCKPT_ERR_LAYOUT);
  EXPECT_STREQ(shardckpt_last_error(), "layers.0.in_proj.weight: heads (6) does not divide by TP 4");
  p.divisors = nullptr;
  EXPECT_EQ(shardckpt_shard_rows(&p, nullptr, nullptr), SHARDCKPT_ERR_INVALID_ARGUMENT);
}

TEST_F(CApi, ValuesOfAnotherKindOrKeyAreRefused) {
  const std::string file = save(1, 0);
  std::vector<Rank> ranks = ranks_at(1, 0, false);
  shardckpt_values* values = nullptr;
  ASSERT_EQ(shardckpt_load_into(file.c_str(), ranks[0].state, &values), SHARDCKPT_OK) << shardckpt_last_error();
  double d = 0;
  EXPECT_EQ(shardckpt_values_double(values, "step", &d), SHARDCKPT_ERR_DTYPE_MISMATCH);
  EXPECT_STREQ(shardckpt_last_error(), "common value step is an int, not a double");
  std::int64_t i = 0;
  EXPECT_EQ(shardckpt_values_int(values, "epoch", &i), SHARDCKPT_ERR_MISSING_KEY);
  EXPECT_STREQ(shardckpt_last_error(), "no common value epoch in the checkpoint");
  shardckpt_values_free(values);
}

TEST_F(CApi, FailuresOfTheFileAndOfArgumentsHaveCodes) {
  std::vector<Rank> ranks = ranks_at(1, 0, true);
  EXPECT_EQ(shardckpt_save(ranks[0].state, nullptr), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(shardckpt_save(nullptr, path("x.h5").c_str()), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(shardckpt_last_error(), "shardckpt_save: state is NULL");
  EXPECT_NE(shardckpt_load_into(path("absent.h5").c_str(), ranks[0].state, nullptr), SHARDCKPT_OK);
  EXPECT_NE(std::string(shardckpt_last_error()).find("absent.h5"), std::string::npos) << shardckpt_last_error();
  const std::string junk = path("junk.h5");
  std::FILE* f = std::fopen(junk.c_str(), "w");
  std::fputs("not a checkpoint", f);
  std::fclose(f);
  EXPECT_EQ(shardckpt_load_into(junk.c_str(), ranks[0].state, nullptr), SHARDCKPT_ERR_NOT_A_CHECKPOINT)
      << shardckpt_last_error();
  shardckpt_state* none[] = {ranks[0].state, nullptr};
  EXPECT_EQ(shardckpt_save_ranks(none, 2, path("x.h5").c_str()), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(shardckpt_last_error(), "the state of rank 1 is NULL");
}

TEST_F(CApi, TheLastErrorBelongsToItsThread) {
  EXPECT_EQ(shardckpt_state_add_int(nullptr, "k", 1), SHARDCKPT_ERR_INVALID_ARGUMENT);
  std::thread([] {
    EXPECT_EQ(shardckpt_last_errc(), SHARDCKPT_OK);
    EXPECT_STREQ(shardckpt_last_error(), "");
    EXPECT_EQ(shardckpt_state_add_string(nullptr, "k", "v"), SHARDCKPT_ERR_INVALID_ARGUMENT);
  }).join();
  EXPECT_STREQ(shardckpt_last_error(), "shardckpt_state_add_int: state is NULL");
}

// A plain f32 weight of 1024 x 256 (1 MiB, whole pages in the file), saved by one process.
class CApiRead : public CApi {
 protected:
  static constexpr std::int64_t big_rows = 1024, big_cols = 256;
  std::string save_big() {
    big_.resize(static_cast<std::size_t>(big_rows * big_cols));
    for (std::size_t i = 0; i < big_.size(); ++i) big_[i] = static_cast<float>(i);
    const shardckpt_section plain[] = {{"", big_rows}};
    shardckpt_param p{};
    p.key = "embed.weight";
    p.sections = plain;
    p.section_count = 1;
    p.trailing = &big_cols;
    p.trailing_count = 1;
    p.tp_axis = SHARDCKPT_TP_ROWS;
    p.tp = p.gtp = 1;
    p.dtype = SHARDCKPT_F32;
    p.shard = big_.data();
    p.shard_bytes = big_.size() * sizeof(float);
    shardckpt_state* state = shardckpt_state_new();
    EXPECT_EQ(shardckpt_state_add_param(state, &p), SHARDCKPT_OK) << shardckpt_last_error();
    EXPECT_EQ(shardckpt_state_add_int(state, "step", 7), SHARDCKPT_OK);
    const std::string to = path("big.h5");
    EXPECT_EQ(shardckpt_save(state, to.c_str()), SHARDCKPT_OK) << shardckpt_last_error();
    shardckpt_state_free(state);
    return to;
  }
  std::vector<float> big_;
};

// Whether memory at `p` is a mapping of the file at `file` (/proc/self/maps names it).
bool mapped_from(const void* p, const std::string& file) {
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  char line[4096];
  bool found = false;
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  while (!found && std::fgets(line, sizeof line, maps)) {
    unsigned long begin = 0, end = 0;
    if (std::sscanf(line, "%lx-%lx", &begin, &end) == 2 && at >= begin && at < end)
      found = std::strstr(line, fs::canonical(file).c_str()) != nullptr;
  }
  std::fclose(maps);
  return found;
}

TEST_F(CApiRead, ReadGivesWholeTensorsAndValuesAndMapsWhatLiesInTheFileAsItIs) {
  const std::string fused = save(2, 16), big = save_big();
  for (const int map : {1, 0}) {
    shardckpt_tensors* t = nullptr;
    shardckpt_values* v = nullptr;
    ASSERT_EQ(shardckpt_read(big.c_str(), 1, 0, map, &t, &v), SHARDCKPT_OK) << shardckpt_last_error();
    ASSERT_EQ(shardckpt_tensors_count(t), 1u);
    EXPECT_STREQ(shardckpt_tensors_key(t, 0), "embed.weight");
    EXPECT_EQ(shardckpt_tensors_key(t, 1), nullptr);
    shardckpt_tensor w{};
    ASSERT_EQ(shardckpt_tensors_get(t, "embed.weight", &w), SHARDCKPT_OK) << shardckpt_last_error();
    EXPECT_EQ(w.dtype, SHARDCKPT_F32);
    ASSERT_EQ(w.rank, 2u);
    EXPECT_EQ(w.shape[0], big_rows);
    EXPECT_EQ(w.shape[1], big_cols);
    ASSERT_EQ(w.bytes, big_.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(w.data, big_.data(), w.bytes), 0);
    EXPECT_EQ(mapped_from(w.data, big), map == 1) << "map " << map;
    std::int64_t step = 0;
    EXPECT_EQ(shardckpt_values_int(v, "step", &step), SHARDCKPT_OK);
    EXPECT_EQ(step, 7);
    static_cast<float*>(w.data)[0] = -1;  // private memory: the file keeps its bytes
    shardckpt_values_free(v);
    shardckpt_tensors_free(t);
  }
  shardckpt_tensors* t = nullptr;
  ASSERT_EQ(shardckpt_read(fused.c_str(), 1, 0, 1, &t, nullptr), SHARDCKPT_OK) << shardckpt_last_error();
  shardckpt_tensor w{};
  ASSERT_EQ(shardckpt_tensors_get(t, "layers.0.in_proj.weight", &w), SHARDCKPT_OK) << shardckpt_last_error();
  ASSERT_EQ(w.rank, 2u);
  EXPECT_EQ(w.shape[0], rows);  // no pad rows: the whole weight, its blocks joined in row order
  ASSERT_EQ(w.bytes, static_cast<std::size_t>(rows * cols) * sizeof(float));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) EXPECT_EQ(static_cast<const float*>(w.data)[r * cols + c], value(r, c));
  shardckpt_tensors_free(t);
}

TEST_F(CApiRead, ATpRankReadsItsRowsAndBadArgumentsHaveCodes) {
  const std::string big = save_big();
  shardckpt_tensors* t = nullptr;
  ASSERT_EQ(shardckpt_read(big.c_str(), 4, 3, 1, &t, nullptr), SHARDCKPT_OK) << shardckpt_last_error();
  shardckpt_tensor w{};
  ASSERT_EQ(shardckpt_tensors_get(t, "embed.weight", &w), SHARDCKPT_OK);
  EXPECT_EQ(w.shape[0], big_rows / 4);
  EXPECT_EQ(std::memcmp(w.data, big_.data() + 3 * big_.size() / 4, w.bytes), 0);
  EXPECT_EQ(shardckpt_tensors_get(t, "absent", &w), SHARDCKPT_ERR_MISSING_KEY);
  EXPECT_STREQ(shardckpt_last_error(), "tensor absent is not in what was read");
  EXPECT_EQ(shardckpt_tensors_get(t, nullptr, &w), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(shardckpt_tensors_get(t, "embed.weight", nullptr), SHARDCKPT_ERR_INVALID_ARGUMENT);
  shardckpt_tensors_free(t);
  EXPECT_EQ(shardckpt_read(big.c_str(), 1, 0, 1, nullptr, nullptr), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(shardckpt_last_error(), "shardckpt_read: tensors is NULL");
  t = reinterpret_cast<shardckpt_tensors*>(&w);  // set to NULL on failure
  EXPECT_NE(shardckpt_read(big.c_str(), 3, 0, 1, &t, nullptr), SHARDCKPT_OK);  // 1024 rows do not split by 3
  EXPECT_EQ(t, nullptr);
  EXPECT_NE(std::string(shardckpt_last_error()).find("embed.weight"), std::string::npos) << shardckpt_last_error();
  EXPECT_NE(shardckpt_read(path("absent.h5").c_str(), 1, 0, 1, &t, nullptr), SHARDCKPT_OK);
  EXPECT_EQ(shardckpt_tensors_count(nullptr), 0u);
  EXPECT_EQ(shardckpt_tensors_key(nullptr, 0), nullptr);
  shardckpt_tensors_free(nullptr);
}

// shardckpt_inspect gives what `shardckpt inspect --json` prints: one report, built by the library.
TEST_F(CApiRead, InspectGivesTheCheckpointAsJson) {
  const std::string big = save_big(), fused = save(2, 16);
  char* text = nullptr;
  ASSERT_EQ(shardckpt_inspect(big.c_str(), &text), SHARDCKPT_OK) << shardckpt_last_error();
  const nlohmann::json j = nlohmann::json::parse(text);
  shardckpt_string_free(text);
  EXPECT_EQ(j["file"], big);
  EXPECT_EQ(j["kind"], "global");
  EXPECT_EQ(j["checksummed"], true);
  EXPECT_EQ(j["common"]["step"], 7);
  ASSERT_EQ(j["tensors"].size(), 1u);
  EXPECT_EQ(j["tensors"][0]["key"], "embed.weight");
  EXPECT_EQ(j["tensors"][0]["dtype"], "f32");
  EXPECT_EQ(j["tensors"][0]["global_shape"], nlohmann::json({big_rows, big_cols}));
  EXPECT_EQ(j["tensors"][0]["bytes"], big_rows * big_cols * 4);
  EXPECT_EQ(j["bytes"], big_rows * big_cols * 4);
  ASSERT_EQ(shardckpt_inspect(fused.c_str(), &text), SHARDCKPT_OK) << shardckpt_last_error();
  const nlohmann::json f = nlohmann::json::parse(text);
  shardckpt_string_free(text);
  ASSERT_EQ(f["params"].size(), 1u);
  EXPECT_GT(f["params"][0]["blocks"].size(), 1u);  // a fused weight: its blocks, each a dataset
  EXPECT_EQ(f["tensors"].size(), f["params"][0]["blocks"].size());
  char junk = 'x';
  text = &junk;  // set to NULL on failure
  EXPECT_EQ(shardckpt_inspect(path("absent.h5").c_str(), &text), SHARDCKPT_ERR_NOT_A_CHECKPOINT)
      << shardckpt_last_error();
  EXPECT_EQ(text, nullptr);
  EXPECT_EQ(shardckpt_inspect(big.c_str(), nullptr), SHARDCKPT_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(shardckpt_last_error(), "shardckpt_inspect: json is NULL");
  shardckpt_string_free(nullptr);
}

TEST_F(CApiRead, AChangedByteInAMappedTensorIsCorruptNotATensor) {
  const std::string big = save_big();
  std::FILE* f = std::fopen(big.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::vector<char> bytes(static_cast<std::size_t>(fs::file_size(big)));
  ASSERT_EQ(std::fread(bytes.data(), 1, bytes.size(), f), bytes.size());
  const float row_700 = static_cast<float>(700 * big_cols);  // the first element of row 700
  std::size_t at = 0;
  for (std::size_t i = 0; i + sizeof(float) <= bytes.size() && at == 0; i += sizeof(float))
    if (std::memcmp(bytes.data() + i, &row_700, sizeof(float)) == 0) at = i;
  ASSERT_NE(at, 0u);
  std::fseek(f, static_cast<long>(at), SEEK_SET);
  std::fputc(bytes[at] ^ 1, f);
  std::fclose(f);
  for (const int map : {1, 0}) {
    shardckpt_tensors* t = nullptr;
    EXPECT_EQ(shardckpt_read(big.c_str(), 1, 0, map, &t, nullptr), SHARDCKPT_ERR_CORRUPT) << "map " << map;
    EXPECT_EQ(t, nullptr);
    EXPECT_NE(std::string(shardckpt_last_error()).find("rows [700, 701)"), std::string::npos) << shardckpt_last_error();
  }
}

TEST(CApiNames, CodesAndVersionHaveNames) {
  EXPECT_STREQ(shardckpt_errc_name(SHARDCKPT_OK), "ok");
  EXPECT_STREQ(shardckpt_errc_name(SHARDCKPT_ERR_MISSING_KEY), "missing_key");
  EXPECT_STREQ(shardckpt_errc_name(SHARDCKPT_ERR_INTERNAL), "internal");
  EXPECT_STREQ(shardckpt_errc_name(SHARDCKPT_ERR_SHARD_CHANGED), "shard_changed");
  EXPECT_STREQ(shardckpt_errc_name(SHARDCKPT_ERR_COMMITTED_PEER_FAILED), "committed_peer_failed");
  EXPECT_STREQ(shardckpt_errc_name(SHARDCKPT_ERR_COMMITTED_PEER_FAILED + 1), "unknown");
  EXPECT_STREQ(shardckpt_errc_name(-1), "unknown");
  EXPECT_GT(std::strlen(shardckpt_version()), 0u);
}

}  // namespace
