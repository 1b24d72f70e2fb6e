// Tests for shardckpt.views: ownership rules (at compile time), views, materialization and dtypes.
#include <gtest/gtest.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
import shardckpt.core;
import shardckpt.views;

using namespace shardckpt;

// Owners are move-only; nothing converts a view into an owner.
static_assert(!std::is_copy_constructible_v<HostBuffer>);
static_assert(!std::is_copy_assignable_v<HostBuffer>);
static_assert(std::is_nothrow_move_constructible_v<HostBuffer>);
static_assert(!std::is_constructible_v<HostBuffer, TensorView>);
static_assert(!std::is_convertible_v<TensorView, HostBuffer>);
static_assert(!std::is_convertible_v<MutTensorView, HostBuffer>);
// Views are cheap values; a mutable view narrows to a read-only one, never the reverse.
static_assert(std::is_trivially_copyable_v<TensorView>);
static_assert(std::is_convertible_v<MutTensorView, TensorView>);
static_assert(!std::is_convertible_v<TensorView, MutTensorView>);
// A view cannot be taken of a temporary owner, nor a mutable view of a const one.
template <class B>
concept CanView = requires(B&& b) { std::forward<B>(b).view(); };
template <class B>
concept CanMutView = requires(B&& b) { std::forward<B>(b).mut_view(); };
static_assert(CanView<HostBuffer&> && CanView<const HostBuffer&> && CanMutView<HostBuffer&>);
static_assert(!CanView<HostBuffer&&> && !CanView<HostBuffer>);
static_assert(!CanMutView<HostBuffer&&> && !CanMutView<const HostBuffer&>);
// Shapes are compile-time vocabulary.
static_assert(Extents{2, 3, 4}.row_elems() == 12);

TEST(Views, RowsViewTheSameMemory) {
  HostBuffer b = HostBuffer::zeros(DType::f32, {6, 2});
  auto all = b.mut_view().as<float>();
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<float>(i);
  const TensorView mid = b.view().rows(2, 5);
  EXPECT_EQ(mid.rows(), 3);
  EXPECT_EQ(mid.data(), b.view().data() + 2 * 2 * sizeof(float));
  EXPECT_EQ(mid.as<float>()[0], 4.0f);
  EXPECT_EQ(mid.bytes(), 24u);
  EXPECT_TRUE(b.view().rows(3, 3).empty());
}

TEST(Views, OutOfRangeRowsAreAnError) {
  HostBuffer b = HostBuffer::zeros(DType::bf16, {4, 2});
  try {
    (void)b.view().rows(2, 5);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_STREQ(e.what(), "rows [2, 5) are outside a view of 4 rows");
  }
}

TEST(Views, ReadingAsTheWrongTypeIsAnError) {
  HostBuffer b = HostBuffer::zeros(DType::bf16, {4});
  EXPECT_EQ(b.view().as<bf16>().size(), 4u);
  EXPECT_THROW((void)b.view().as<float>(), Error);
}

TEST(Owners, AreAlignedAndMoveLeavesTheSourceEmpty) {
  HostBuffer a = HostBuffer::zeros(DType::f64, {3, 3});
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.view().data()) % HostBuffer::alignment, 0u);
  const auto* data = a.view().data();
  HostBuffer b = std::move(a);
  EXPECT_EQ(b.view().data(), data);
  EXPECT_EQ(b.bytes(), 72u);
  EXPECT_EQ(a.bytes(), 0u);  // NOLINT(bugprone-use-after-move): moved-from state is specified
}

TEST(Materialize, IsCountedAndCopies) {
  HostBuffer a = HostBuffer::zeros(DType::i32, {3});
  a.mut_view().as<std::int32_t>()[1] = 7;
  const auto before = materialization_count();
  HostBuffer b = materialize(a.view());
  EXPECT_EQ(materialization_count(), before + 1);
  EXPECT_NE(b.view().data(), a.view().data());
  EXPECT_EQ(b.view().as<std::int32_t>()[1], 7);
  HostBuffer c = a.deep_copy();
  EXPECT_EQ(materialization_count(), before + 2);
}

TEST(Materialize, ForbiddenMaterializationIsCaught) {
  HostBuffer a = HostBuffer::zeros(DType::f32, {8, 4});
  const auto before = materialization_count();
  {
    ForbidMaterialization outer;
    {
      ForbidMaterialization inner;
      EXPECT_TRUE(materialization_forbidden());
    }
    EXPECT_TRUE(materialization_forbidden());  // still inside the outer guard
    try {
      (void)materialize(a.view().rows(0, 2));
      FAIL() << "a forbidden materialization went through";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::materialization_forbidden);
    }
    EXPECT_THROW((void)a.deep_copy(), Error);
  }
  EXPECT_FALSE(materialization_forbidden());
  EXPECT_EQ(materialization_count(), before);
  EXPECT_NO_THROW((void)materialize(a.view()));
}

TEST(Dtypes, SizesAndNamesRoundTrip) {
  for (DType t : all_dtypes) EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::u64), 8u);
  EXPECT_THROW((void)parse_dtype("f8"), Error);
}

TEST(Dtypes, Bf16RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(to_bf16(1.00390625f).bits, 0x3F80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties go up to even.
  EXPECT_EQ(to_bf16(1.01171875f).bits, 0x3F82);
  EXPECT_EQ(to_f32(to_bf16(-2.5f)), -2.5f);
  EXPECT_EQ(to_f32(to_bf16(16777215.0f)), 16777216.0f);
  EXPECT_TRUE(std::isnan(to_f32(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(to_f32(to_bf16(std::numeric_limits<float>::infinity()))));
}

TEST(Dtypes, F16RoundsToNearestEvenIncludingSubnormals) {
  EXPECT_EQ(to_f16(1.0f).bits, 0x3C00);
  EXPECT_EQ(to_f16(65504.0f).bits, 0x7BFF);
  EXPECT_EQ(to_f16(65520.0f).bits, 0x7C00);                 // halfway past the largest half: infinity
  EXPECT_EQ(to_f16(1.0f + 1.0f / 2048).bits, 0x3C00);       // tie -> even
  EXPECT_EQ(to_f16(1.0f + 3.0f / 2048).bits, 0x3C02);       // tie -> even (up)
  EXPECT_EQ(to_f16(5.9604644775390625e-8f).bits, 0x0001);   // smallest subnormal
  EXPECT_EQ(to_f16(2.98023223876953125e-8f).bits, 0x0000);  // half of it: tie -> even (zero)
  EXPECT_EQ(to_f16(-0.0f).bits, 0x8000);
  for (std::uint32_t bits = 0; bits < 0x7C00; bits += 7) {
    const f16 h{static_cast<std::uint16_t>(bits)};
    EXPECT_EQ(to_f16(to_f32(h)).bits, h.bits) << bits;
  }
  EXPECT_TRUE(std::isnan(to_f32(to_f16(std::nanf("")))));
}
