// Tests for shardckpt.core: checked arithmetic, the dtype table, and the 16-bit float types; and for
// shardckpt.guarded, the types that hold shared state.
#include <gtest/gtest.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <atomic>
#include <chrono>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>
import shardckpt.core;
import shardckpt.guarded;  // internal: its types, tested directly

using namespace shardckpt;

// A 16-bit float is never built from a number by accident: bf16(3.0f) would store the bits 3.
static_assert(!std::is_constructible_v<bf16, float>);
static_assert(!std::is_constructible_v<bf16, double>);
static_assert(!std::is_constructible_v<bf16, int>);
static_assert(!std::is_convertible_v<float, bf16>);
static_assert(!std::is_constructible_v<f16, float>);
static_assert(!std::is_constructible_v<f16, std::uint16_t>);
static_assert(std::is_trivially_copyable_v<bf16> && sizeof(bf16) == 2);
// The C++ type of every dtype comes from the one table.
static_assert(dtype_v<float> == DType::f32 && dtype_v<bf16> == DType::bf16 && dtype_v<const std::int8_t> == DType::i8);
static_assert(!Element<char> && !Element<long double>);

namespace {

template <class Fn>
Errc error_code_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no error";
  return Errc::internal;
}

}  // namespace

TEST(Checked, OverflowIsATypedErrorNamingWhat) {
  constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(checked_add(big - 1, 1, "x"), big);
  EXPECT_EQ(checked_mul(1 << 20, 1 << 20, "x"), std::int64_t{1} << 40);
  EXPECT_EQ(error_code_of([&] { (void)checked_add(big, 1, "rows"); }), Errc::invalid_argument);
  EXPECT_EQ(error_code_of([&] { (void)checked_mul(big / 2, 3, "bytes", Errc::not_a_checkpoint); }),
            Errc::not_a_checkpoint);
  try {
    (void)checked_mul(std::int64_t{1} << 62, 4, "alignment x GTP group size");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("alignment x GTP group size"), std::string::npos) << e.what();
  }
}

TEST(Checked, ElementCountRefusesNegativeDimsAndOverflow) {
  const std::int64_t ok[] = {3, 4, 5}, none[] = {0, 7}, neg[] = {3, -1}, huge[] = {1 << 30, 1 << 30, 1 << 30};
  EXPECT_EQ(element_count(ok), 60);
  EXPECT_EQ(element_count(none), 0);
  EXPECT_EQ(element_count(std::span<const std::int64_t>()), 1);
  EXPECT_EQ(error_code_of([&] { (void)element_count(neg); }), Errc::invalid_argument);
  EXPECT_EQ(error_code_of([&] { (void)element_count(huge); }), Errc::invalid_argument);
}

TEST(Dtypes, SizesAndNamesRoundTrip) {
  for (const DTypeInfo& t : dtype_table) EXPECT_EQ(parse_dtype(t.name), t.dtype);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::u64), 8u);
  EXPECT_THROW((void)parse_dtype("f8"), Error);
}

TEST(Dtypes, Bf16RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits(), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(to_bf16(1.00390625f).bits(), 0x3F80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go up to even.
  EXPECT_EQ(to_bf16(1.01171875f).bits(), 0x3F82);
  EXPECT_EQ(to_f32(to_bf16(-2.5f)), -2.5f);
  EXPECT_EQ(to_f32(to_bf16(16777215.0f)), 16777216.0f);
  EXPECT_TRUE(std::isnan(to_f32(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(to_f32(to_bf16(std::numeric_limits<float>::infinity()))));
}

TEST(Dtypes, F16RoundsToNearestEvenIncludingSubnormals) {
  EXPECT_EQ(to_f16(1.0f).bits(), 0x3C00);
  EXPECT_EQ(to_f16(65504.0f).bits(), 0x7BFF);
  EXPECT_EQ(to_f16(65520.0f).bits(), 0x7C00);                 // halfway past the largest half: infinity
  EXPECT_EQ(to_f16(1.0f + 1.0f / 2048).bits(), 0x3C00);       // tie -> even
  EXPECT_EQ(to_f16(1.0f + 3.0f / 2048).bits(), 0x3C02);       // tie -> even (up)
  EXPECT_EQ(to_f16(5.9604644775390625e-8f).bits(), 0x0001);   // smallest subnormal
  EXPECT_EQ(to_f16(2.98023223876953125e-8f).bits(), 0x0000);  // half of it: tie -> even (zero)
  EXPECT_EQ(to_f16(-0.0f).bits(), 0x8000);
  for (std::uint32_t bits = 0; bits < 0x7C00; bits += 7) {
    const f16 h = f16::from_bits(static_cast<std::uint16_t>(bits));
    EXPECT_EQ(to_f16(to_f32(h)).bits(), h.bits()) << bits;
  }
  EXPECT_TRUE(std::isnan(to_f32(to_f16(std::nanf("")))));
}

// A Lazy is made once however many threads ask at once, and all of them get the one value.
TEST(Lazy, IsMadeOnceForThreadsThatAskTogether) {
  const Lazy<std::vector<int>> lazy;
  std::atomic<int> made{0};
  std::vector<const std::vector<int>*> got(8);
  {
    std::vector<std::jthread> threads;
    for (std::size_t t = 0; t < got.size(); ++t)
      threads.emplace_back([&, t] {
        got[t] = &lazy.get([&] {
          ++made;
          std::this_thread::yield();
          return std::vector<int>(1000, 7);
        });
      });
  }
  EXPECT_EQ(made.load(), 1);
  for (const auto* v : got) {
    EXPECT_EQ(v, got[0]);
    EXPECT_EQ(v->size(), 1000u);
  }
  EXPECT_TRUE(lazy.made());
}

// A maker that throws leaves the Lazy unmade: the error reaches its caller, the next caller makes it.
TEST(Lazy, StaysUnmadeWhenItsMakerThrows) {
  const Lazy<int> lazy;
  EXPECT_THROW((void)lazy.get([]() -> int { throw std::runtime_error("no"); }), std::runtime_error);
  EXPECT_FALSE(lazy.made());
  EXPECT_EQ(lazy.get([] { return 5; }), 5);
  EXPECT_EQ(lazy.get([] { return 6; }), 5);  // made once: never changed after
}

// A Guarded value is reached only while its lock is held: two threads adding under it never lose an
// addition, and a thread that takes the lock waits for the handle another holds.
TEST(Guarded, HoldsItsLockAsLongAsTheHandle) {
  const Guarded<std::vector<int>> g;
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&] {
        for (int i = 0; i < 1000; ++i) g.lock()->push_back(i);
      });
  }
  EXPECT_EQ(g.lock()->size(), 4000u);
  std::atomic<bool> entered{false};
  std::jthread other;
  {
    const auto held = g.lock();
    other = std::jthread([&] {
      (void)g.lock();
      entered = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(entered.load()) << "another thread took the lock while a handle held it";
  }
  other.join();  // the handle is gone: the other thread gets the lock
  EXPECT_TRUE(entered.load());
}
