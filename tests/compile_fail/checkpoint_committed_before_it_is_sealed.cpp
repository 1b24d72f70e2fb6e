// rejects: no member named 'commit' in 'shardckpt::WrittenCheckpoint'
// Written is not sealed: a checkpoint is committed only after its seal.
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p) {
  CheckpointWriter w = CheckpointWriter::create(io::Destination::of(p), {}, {}, 0);
  PiecesWritten done = w.pieces(IoMethod::raw, 0).finish();
  std::move(w).written(std::move(done)).commit();
}
