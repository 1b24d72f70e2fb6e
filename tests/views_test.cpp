// Tests for shardckpt.views: ownership rules (at compile time), views and materialization.
#include <gtest/gtest.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>
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
  const TensorView mid = b.view().slice_rows(2, 5);
  EXPECT_EQ(mid.rows(), 3);
  EXPECT_EQ(mid.data(), b.view().data() + 2 * 2 * sizeof(float));
  EXPECT_EQ(mid.as<float>()[0], 4.0f);
  EXPECT_EQ(mid.bytes(), 24u);
  EXPECT_TRUE(b.view().slice_rows(3, 3).empty());
}

TEST(Views, OutOfRangeRowsAreAnError) {
  HostBuffer b = HostBuffer::zeros(DType::bf16, {4, 2});
  try {
    (void)b.view().slice_rows(2, 5);
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
      (void)materialize(a.view().slice_rows(0, 2));
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

// Ownership the types cannot check is checked when it is made: a view of a raw pointer (named
// unchecked) refuses a null or misaligned pointer, a shared buffer refuses a shape its allocation
// does not hold, and a read-only entry refuses to lend mutable memory.
TEST(Ownership, ReinterpretingADtypeIsNamedAndChecked) {
  HostBuffer b = HostBuffer::zeros(DType::bf16, {3, 4});
  b.mut_view().as<bf16>()[5] = to_bf16(2.0f);
  const TensorView bits = b.view().reinterpreted_as(DType::u16);  // the same bytes, as u16
  EXPECT_EQ(bits.shape(), Extents({3, 4}));
  EXPECT_EQ(bits.data(), b.view().data());
  EXPECT_EQ(bits.as<std::uint16_t>()[5], to_bf16(2.0f).bits());
  const TensorView words = b.view().reinterpreted_as(DType::f32);  // each row keeps its 8 bytes
  EXPECT_EQ(words.shape(), Extents({3, 2}));
  EXPECT_EQ(words.reinterpreted_as(DType::u8).shape(), Extents({3, 8}));
  EXPECT_EQ(b.mut_view().reinterpreted_as(DType::i64).shape(), Extents({3, 1}));
  const auto thrown = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return Errc::internal;
  };
  HostBuffer odd = HostBuffer::zeros(DType::bf16, {2, 3});  // 6-byte rows
  EXPECT_EQ(thrown([&] { (void)odd.view().reinterpreted_as(DType::f32); }), Errc::dtype_mismatch);
  EXPECT_EQ(thrown([&] { (void)odd.view().slice_rows(0, 1).reinterpreted_as(DType::f64); }), Errc::dtype_mismatch);
  // Host memory not aligned to the new elements is refused, as when the view was made.
  const TensorView shifted = TensorView::unchecked(b.view().data() + 2, DType::bf16, {1, 4});
  EXPECT_EQ(thrown([&] { (void)shifted.reinterpreted_as(DType::f32); }), Errc::invalid_argument);
}

TEST(Ownership, WhatTheTypesCannotCheckIsCheckedWhenMade) {
  std::vector<float> memory(8);
  EXPECT_EQ(TensorView::unchecked(memory.data(), DType::f32, {2, 4}).rows(), 2);
  Error e(Errc::internal, "");
  try {
    (void)TensorView::unchecked(nullptr, DType::f32, {2, 4});
  } catch (const Error& caught) {
    e = caught;
  }
  EXPECT_EQ(e.code(), Errc::invalid_argument);
  EXPECT_NO_THROW((void)TensorView::unchecked(nullptr, DType::f32, {0, 4}));  // nothing to point at
  const auto* misaligned = reinterpret_cast<const std::byte*>(memory.data()) + 2;
  EXPECT_THROW((void)TensorView::unchecked(misaligned, DType::f32, {1}), Error);
  EXPECT_NO_THROW((void)TensorView::unchecked(misaligned, DType::u8, {1}));

  struct Fixed final : Allocation {
    explicit Fixed(std::vector<float>& v) : Allocation(v.data(), v.size() * sizeof(float), MemorySpace::host()) {}
  };
  const auto alloc = std::make_shared<Fixed>(memory);
  EXPECT_EQ(SharedBuffer(alloc, DType::f32, {2, 4}).bytes(), 32u);
  EXPECT_THROW(SharedBuffer(alloc, DType::f32, {3, 4}), Error);  // 48 bytes in an allocation of 32

  SharedBuffer owner = SharedBuffer::zeros(DType::f32, {4});
  TensorRef writable = owner;
  EXPECT_TRUE(writable.writable());
  EXPECT_NO_THROW((void)writable.mut_view());
  TensorRef saved = TensorRef::read_only(static_cast<const SharedBuffer&>(owner));
  EXPECT_FALSE(saved.writable());
  EXPECT_TRUE(saved.owning());
  EXPECT_THROW((void)saved.mut_view(), Error);
  TensorRef borrowed = unchecked_borrow(static_cast<const SharedBuffer&>(owner).view());
  EXPECT_FALSE(borrowed.writable());
  EXPECT_THROW((void)borrowed.mut_view(), Error);
}
