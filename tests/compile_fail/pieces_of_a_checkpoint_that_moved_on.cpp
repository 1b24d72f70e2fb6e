// rejects: invalid invocation of method 'pieces' on object 'w' while it is in the 'consumed' state
// Once written, a checkpoint takes no more pieces: the created step is gone (-Wconsumed).
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p) {
  CheckpointWriter w = CheckpointWriter::create(io::Destination::of(p), {}, {}, 0);
  PiecesWritten done = w.pieces(IoMethod::raw, 0).finish();
  WrittenCheckpoint written = std::move(w).written(std::move(done));
  (void)w.pieces(IoMethod::raw, 0);
  std::move(written).seal().commit();
}
