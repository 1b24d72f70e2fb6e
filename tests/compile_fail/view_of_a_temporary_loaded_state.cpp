// rejects: call to deleted member function 'tensor'
// A tensor of a loaded state lives as long as the loaded state.
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p, const StateDict& request) {
  const SharedBuffer& t = load(p, request).tensor("k");
  (void)t;
}
