// rejects: but function has rvalue ref-qualifier
// A step consumes its checkpoint: it is taken on std::move(step), never on a name that lives on.
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p) {
  CheckpointWriter w = CheckpointWriter::create(io::Destination::of(p), {}, {}, 0);
  PiecesWritten done = w.pieces(IoMethod::raw, 0).finish();
  SealedCheckpoint sealed = std::move(w).written(std::move(done)).seal();
  sealed.commit();
}
