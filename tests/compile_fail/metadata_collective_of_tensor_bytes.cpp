// rejects: 'all_gather' is a protected member of 'shardckpt::ProcessGroup'
// Gathering a tensor's bytes would build a full tensor: only the library's protocols gather bytes;
// rows move in place with all_gather_rows.
#include <span>
import shardckpt;
using namespace shardckpt;

void f(ProcessGroup& g, TensorView v) { (void)g.all_gather(std::span(v.data(), v.bytes())); }
