// rejects: temporary bound to local reference 'e' will be destroyed
import shardckpt;
using namespace shardckpt;

long f() {
  const Extents& e = SharedBuffer::zeros(DType::f32, {4, 2}).shape();
  return e.rows();
}
