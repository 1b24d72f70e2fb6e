// rejects: call to deleted member function 'mut_view'
// A const owner lends no mutable memory: the same rule as HostBuffer's, for shared ownership.
import shardckpt;
using namespace shardckpt;

MutTensorView f(const SharedBuffer& b) { return b.mut_view(); }
