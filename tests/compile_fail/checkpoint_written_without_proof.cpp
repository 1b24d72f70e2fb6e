// rejects: calling a private constructor of class 'shardckpt::PiecesWritten'
// Only a PieceWriter's finish() (or write_checksums) proves pieces written: no proof can be made up.
#include <filesystem>
import shardckpt;
using namespace shardckpt;

void f(const std::filesystem::path& p, const io::File& file) {
  CheckpointWriter w = CheckpointWriter::create(io::Destination::of(p), {}, {}, 0);
  std::move(w).written(PiecesWritten(file)).seal().commit();
}
