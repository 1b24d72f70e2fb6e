// rejects: invalid invocation of method 'commit' on a temporary object while it is in the 'consumed' state
// A commit consumes the checkpoint: a second one on the same object does not compile (-Wconsumed).
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p) {
  CheckpointWriter w = CheckpointWriter::create(io::Destination::of(p), {}, {}, 0);
  PiecesWritten done = w.pieces(IoMethod::raw, 0).finish();
  SealedCheckpoint sealed = std::move(w).written(std::move(done)).seal();
  std::move(sealed).commit();
  std::move(sealed).commit();
}
