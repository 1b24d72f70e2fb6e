// rejects: call to deleted member function 'view'
import shardckpt;
using namespace shardckpt;

TensorView f() { return HostBuffer::zeros(DType::f32, {4}).view(); }
