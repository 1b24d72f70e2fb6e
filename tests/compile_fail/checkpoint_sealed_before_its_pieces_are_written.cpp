// rejects: no member named 'seal' in 'shardckpt::CheckpointWriter'
// A checkpoint is sealed only once written: a created one has no seal().
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p) {
  CheckpointWriter w = CheckpointWriter::create(io::Destination::of(p), {}, {}, 0);
  std::move(w).seal().commit();
}
