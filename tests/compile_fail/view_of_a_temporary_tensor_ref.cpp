// rejects: call to deleted member function 'view'
import shardckpt;
using namespace shardckpt;

TensorView f() { return TensorRef(SharedBuffer::zeros(DType::f32, {4})).view(); }
