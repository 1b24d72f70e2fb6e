// rejects: temporary implicitly bound to local reference will be destroyed at the end of the full-expression
// The entries of a state dict live as long as the state dict: a loop over a temporary's would read
// freed memory.
import shardckpt;
using namespace shardckpt;

StateDict request();

long f() {
  long rows = 0;
  for (const ShardedParam& p : request().params()) rows += p.padded_shape().rows();
  return rows;
}
