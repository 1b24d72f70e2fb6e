// rejects: no viable conversion from 'TensorView' (aka 'BasicView<false>') to 'TensorRef'
// The snippet: a state dict that would outlive the buffer its view borrows.
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p) {
  StateDict s;
  {
    HostBuffer b = HostBuffer::zeros(DType::f32, {4, 2});
    s.add(ShardedTensor::of("t", b.view(), {4, 2}, {0, 0}));
  }
  save(s, p);
}
