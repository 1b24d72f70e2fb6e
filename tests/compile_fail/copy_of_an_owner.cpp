// rejects: call to deleted constructor of 'HostBuffer'
// Owners move; a copy is the explicit, counted deep_copy().
import shardckpt;
using namespace shardckpt;

void f() {
  HostBuffer a = HostBuffer::zeros(DType::f32, {4});
  HostBuffer b = a;
  (void)b;
}
