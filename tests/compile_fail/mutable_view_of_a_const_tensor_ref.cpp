// rejects: call to deleted member function 'mut_view'
// A state dict entry seen through a const reference lends no mutable memory.
import shardckpt;
using namespace shardckpt;

MutTensorView f(const TensorRef& r) { return r.mut_view(); }
