// rejects: no matching function for call to 'load_into'
// A load writes into the state dict's memory: it takes the state dict as mutable, never through const.
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p, const StateDict& s) { (void)load_into(p, s); }
