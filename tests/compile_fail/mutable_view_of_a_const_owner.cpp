// rejects: no matching member function for call to 'mut_view'
import shardckpt;
using namespace shardckpt;

MutTensorView f(const HostBuffer& b) { return b.mut_view(); }
