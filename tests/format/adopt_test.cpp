// Tests for adopt: safetensors files built byte by byte here (tests/safetensors_test.py adopts the
// files Hugging Face's own package writes), a fused tensor adopted as its blocks without a copy,
// common values, and headers that must be refused with a typed error naming what is wrong.
#include <cstring>

#include "support.hpp"

namespace {

// The 8-byte little-endian header length, the header, then the data.
void write_safetensors(const std::filesystem::path& path, const std::string& header, const std::string& data,
                       std::optional<std::uint64_t> length = std::nullopt) {
  std::string bytes(8, '\0');
  const std::uint64_t n = length.value_or(header.size());
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>(n >> (8 * i) & 0xff);
  std::ofstream(path, std::ios::binary) << bytes << header << data;
}

// w (f32, 6 x 2): elements 0..11, the fused rows of blocks a (2 rows) and b (4 rows); n (bf16, 3): 1, 2, 3.
std::string fused_data() {
  std::string data(48 + 6, '\0');
  for (int i = 0; i < 12; ++i) {
    const auto v = static_cast<float>(i);
    std::memcpy(data.data() + 4 * i, &v, 4);
  }
  for (int i = 0; i < 3; ++i) {
    const std::uint16_t bits = to_bf16(static_cast<float>(i + 1)).bits();
    std::memcpy(data.data() + 48 + 2 * i, &bits, 2);
  }
  return data;
}
constexpr const char* fused_header =
    R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [6, 2], "data_offsets": [0, 48]},)"
    R"( "n": {"dtype": "BF16", "shape": [3], "data_offsets": [48, 54]}})";
const std::vector<ParamRecord> fused_records{{"w", TpAxis::rows, {{"a", 2}, {"b", 4}}, {2}, {}}};

template <class T>
std::vector<T> read_whole(const CheckpointReader& r, const std::string& key) {
  const Dataset& d = r.dataset(key);
  HostBuffer b = HostBuffer::zeros(d.dtype, Extents(d.shape));
  r.read(d, std::vector<std::int64_t>(d.shape.size(), 0), d.shape, b.mut_view());
  auto v = b.view().as<T>();
  return std::vector<T>(v.begin(), v.end());
}

}  // namespace

TEST(Adopt, AFusedSafetensorsTensorBecomesItsBlocksWithoutACopy) {
  ScratchDir dir;
  write_safetensors(dir / "m.safetensors", fused_header, fused_data());
  const Values common{{"step", std::int64_t{100}}, {"lr", 0.001}, {"name", std::string("run7")}};
  const AdoptReport rep = adopt(dir / "m.safetensors", dir / "m.h5", fused_records, common);
  EXPECT_EQ(rep.tensors, 3);
  EXPECT_EQ(rep.fused, 1);
  EXPECT_EQ(rep.bytes, 54);
  const CheckpointReader r(dir / "m.h5");
  EXPECT_EQ(r.contents().common, common);
  EXPECT_EQ(r.dataset("w.a").shape, (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(read_whole<float>(r, "w.a"), (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ(read_whole<float>(r, "w.b"), (std::vector<float>{4, 5, 6, 7, 8, 9, 10, 11}));
  std::vector<float> n;
  for (const bf16 v : read_whole<bf16>(r, "n")) n.push_back(to_f32(v));
  EXPECT_EQ(n, (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(verify_checkpoint(r).mismatches, 0);
  // The bytes stay in the safetensors file: a changed byte of w's row 3 is block b's row 1.
  flip_byte(dir / "m.safetensors", 8 + std::string(fused_header).size() + 3 * 8);
  const Error e = error_of([&] { (void)read_whole<float>(CheckpointReader(dir / "m.h5"), "w.b"); });
  EXPECT_EQ(e.code(), Errc::corrupt);
  EXPECT_TRUE(contains(e.what(), "w.b, rows [1, 2)")) << e.what();
}

TEST(Adopt, AFusedTensorMustHoldExactlyItsBlocks) {
  ScratchDir dir;
  write_safetensors(dir / "m.safetensors", fused_header, fused_data());
  const std::vector<ParamRecord> short_record{{"w", TpAxis::rows, {{"a", 2}, {"b", 3}}, {2}, {}}};
  const Error e = error_of([&] { (void)adopt(dir / "m.safetensors", dir / "m.h5", short_record, {}); });
  EXPECT_EQ(e.code(), Errc::invalid_argument);
  EXPECT_TRUE(contains(e.what(), "says the fused tensor has shape [5, 2] (its blocks one after another) but w has [6, 2]"))
      << e.what();
  EXPECT_FALSE(std::filesystem::exists(dir / "m.h5"));
}

TEST(Adopt, HostileSafetensorsHeadersAreRefusedNamingWhatIsWrong) {
  struct Case {
    std::string header;
    std::optional<std::uint64_t> length;
    std::string says;
  };
  const std::string t = R"("t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]})";
  const std::vector<Case> cases{
      {"{" + t + "}", 1000, "the header length is 1000 bytes, but only"},
      {"{" + t + "}", 0, "too short for a JSON object"},
      {"{" + t + "}", std::uint64_t{1} << 40, "more than the limit of 100000000"},
      {"{" + t + ", " + t + "}", {}, "the key \"t\" appears twice"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [8, 20]}})", {}, "reach past the data"},
      {R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "u": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
       {}, "tensors \"t\" (data_offsets [0, 8]) and \"u\" ([4, 8]) share bytes"},
      {R"({"t": {"dtype": "F8_E4M3", "shape": [12], "data_offsets": [0, 12]}})", {}, "which shardckpt does not store"},
      {R"({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}})", {}, "has 16 bytes, but its data_offsets [0, 12] hold 12"},
      {R"({"t": {"dtype": "F32", "shape": [[3]], "data_offsets": [0, 12]}})", {}, "nests deeper"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]})", {}, "not valid JSON"},
      {R"({"t": {"dtype": "U8", "shape": [1000000000000, 0], "data_offsets": [0, 0]}})", {}, "rows without elements"},
      {R"({"t": {"dtype": "F32", "shape": [3.0], "data_offsets": [0, 12]}})", {}, "not an integer"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12], "x": 1}})", {}, "unknown field \"x\""},
      {R"({"a/b": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}})", {}, "contain no '/'"},
      // Numbers that are not integers from 0 to 2^63 - 1 are named as the file writes them.
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [-0, 12]}})", {},
       "an offset of its data_offsets is -0, a negative zero (the safetensors package refuses it too: write 0)"},
      {R"({"t": {"dtype": "F32", "shape": [1e2], "data_offsets": [0, 12]}})", {},
       "a dimension of its shape is 1e2, written with a fraction or an exponent"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0.0, 12]}})", {},
       "data_offsets is 0.0, written with a fraction or an exponent"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [-12, 12]}})", {}, "data_offsets is -12, negative:"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [9223372036854775808, 12]}})", {},
       "data_offsets is 9223372036854775808, past 2^63 - 1: not an integer from 0 to 2^63 - 1"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 18446744073709551616]}})", {},
       "data_offsets is 18446744073709551616, past 2^64 - 1"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, "12"]}})", {}, "data_offsets is \"12\", not a number"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [00, 12]}})", {},
       "the number 00 has a leading zero, which JSON does not allow (0 is written without one)"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 012]}})", {}, "the number 012 has a leading zero"},
      {R"({"t": {"dtype": -0, "shape": [3], "data_offsets": [0, 12]}})", {}, "has dtype -0, which shardckpt does not store"},
      {R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 1E400]}})", {}, "number overflow parsing '1E400'"},
  };
  ScratchDir dir;
  for (const Case& c : cases) {
    write_safetensors(dir / "bad.safetensors", c.header, std::string(12, '\0'), c.length);
    const Error e = error_of([&] { (void)adopt(dir / "bad.safetensors", dir / "bad.h5", {}, {}); });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint) << c.header;
    EXPECT_TRUE(contains(e.what(), "bad.safetensors: not a safetensors file shardckpt can adopt: ")) << e.what();
    EXPECT_TRUE(contains(e.what(), c.says)) << e.what();
    EXPECT_FALSE(std::filesystem::exists(dir / "bad.h5")) << c.header;
  }
}

TEST(Adopt, CommonValueKeysFollowTheRuleOfKeys) {
  ScratchDir dir;
  write_safetensors(dir / "m.safetensors", fused_header, fused_data());
  const Error e = error_of([&] { (void)adopt(dir / "m.safetensors", dir / "m.h5", {}, {{"_x", std::int64_t{1}}}); });
  EXPECT_EQ(e.code(), Errc::invalid_argument);
  EXPECT_TRUE(contains(e.what(), "key '_x' cannot name a common value")) << e.what();
}
