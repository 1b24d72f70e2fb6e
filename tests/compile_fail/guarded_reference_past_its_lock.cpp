// rejects: temporary bound to local reference 'v' will be destroyed
// A reference into a Guarded value cannot be kept past the handle that holds its lock: the handle
// is a temporary of the full-expression, and the reference would outlive the lock.
#include <vector>
import shardckpt.guarded;
using namespace shardckpt;

std::size_t f(const Guarded<std::vector<int>>& g) {
  std::vector<int>& v = *g.lock();
  return v.size();
}
