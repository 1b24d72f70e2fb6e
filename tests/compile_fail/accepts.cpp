// The forms the rejected snippets should have used: each compiles (so that the rejections below
// are the library's doing, not a broken harness).
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void shared_ownership(const std::filesystem::path& p) {
  StateDict s;
  {
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {4, 2});
    s.add(ShardedTensor::of("t", b, {4, 2}, {0, 0}));  // the state dict keeps the memory alive
  }
  save(s, p);
}

void explicit_borrow(const std::filesystem::path& p) {
  HostBuffer b = HostBuffer::zeros(DType::f32, {4, 2});
  StateDict s;
  s.add(ShardedTensor::of("t", unchecked_borrow(b.view()), {4, 2}, {0, 0}));  // says it is unchecked
  save(s, p);
}

float views_of_named_owners() {
  HostBuffer b = HostBuffer::zeros(DType::f32, {4});
  const TensorView v = b.view();
  const SharedBuffer shared = SharedBuffer::zeros(DType::f32, {4});
  const TensorRef ref = shared;
  const MutTensorView m = ref.mut_view();
  return v.as<float>()[0] + m.as<float>()[0] + to_f32(to_bf16(3.0f)) + to_f32(bf16::from_bits(0x3f80));
}

HostBuffer counted_copy(const HostBuffer& b) { return b.deep_copy(); }
