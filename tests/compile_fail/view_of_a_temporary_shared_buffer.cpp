// rejects: call to deleted member function 'mut_view'
import shardckpt;
using namespace shardckpt;

MutTensorView f() { return SharedBuffer::zeros(DType::f32, {4}).mut_view(); }
