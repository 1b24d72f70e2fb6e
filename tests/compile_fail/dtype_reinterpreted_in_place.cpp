// rejects: no member named 'retyped'
// Memory of one dtype is not silently seen as another: allocations are typed (allocate_pinned(dtype,
// shape)), and the one way from raw bytes to a view says it is unchecked.
import shardckpt;
using namespace shardckpt;

SharedBuffer f(const SharedBuffer& bytes) { return bytes.retyped(DType::f32, {4}); }
