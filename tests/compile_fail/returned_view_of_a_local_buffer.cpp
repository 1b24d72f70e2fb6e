// rejects: address of stack memory associated with local variable 'b' returned
import shardckpt;
using namespace shardckpt;

TensorView f() {
  HostBuffer b = HostBuffer::zeros(DType::f32, {4});
  return b.view();
}
