module;
#include <hdf5.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :hdf5;
import :raw;
import :records;
import :seal;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using hdf5::check;
using hdf5::Hid;
using hdf5::owned;
using hdf5::Where;

Hid create_dataset(hid_t file, const Dataset& d, const Where& w) {
  Hid dcpl = owned(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, w);
  if (d.external) {
    require(io::plain_name(d.external->file), Errc::invalid_argument, "dataset ", d.key, ": external file '",
            d.external->file, "' is not a plain file name");
    const auto bytes = static_cast<hsize_t>(element_count(d.shape)) * dtype_size(d.dtype);
    check(H5Pset_external(dcpl.get(), d.external->file.c_str(), static_cast<off_t>(d.external->offset), bytes), w);
  } else if (d.chunk.empty()) {
    check(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), w);
  } else {
    const std::vector<hsize_t> chunk(d.chunk.begin(), d.chunk.end());
    check(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()), w);
  }
  // Allocated now and never filled: every byte has a fixed file address before any rank writes,
  // and HDF5 spends no time writing fill values that pieces overwrite.
  if (!d.external) check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), w);
  check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), w);
  const std::vector<hsize_t> dims(d.shape.begin(), d.shape.end());
  // A scalar (shape []) has a scalar dataspace: h5py reads it as shape ().
  Hid space = owned(dims.empty() ? H5Screate(H5S_SCALAR)
                                 : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                    H5Sclose, w);
  Hid type = hdf5::type_of(d.dtype);
  return owned(H5Dcreate2(file, d.key.c_str(), type.get(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
               H5Dclose, w);
}

}  // namespace

// ---- the writer side ----------------------------------------------------------------------------------

namespace {

// The metadata group and the common values: what every checkpoint holds besides its tensors.
void write_metadata(hid_t file, const CheckpointContents& contents, const Where& w) {
  Hid meta = hdf5::create_group(file, meta_group, w);
  hdf5::write_attr(meta.get(), "format", std::string_view("shardckpt"), w);
  hdf5::write_attr(meta.get(), "format_version", std::int64_t{format_version}, w);
  hdf5::write_attr(meta.get(), "kind", std::string_view(contents.kind == CheckpointKind::global ? "global" : "local"), w);
  hdf5::write_attr(meta.get(), "checkpoint_id", std::string_view(contents.id), w);
  hdf5::write_attr(meta.get(), "checksums", contents.checksummed ? checksum_scheme : no_checksums, w);
  hdf5::write_attr(meta.get(), "params", std::string_view(records_json(contents.params)), w);
  meta.close(w);
  Hid common = hdf5::create_group(file, common_group, w);
  for (const auto& [key, value] : contents.common) {
    require_key(key, "a common value");
    if (const auto* text = std::get_if<std::string>(&value)) require_text(key, *text);
    hdf5::write_attr(common.get(), key.c_str(), value, w);
  }
  common.close(w);
}

// The checksum table, allocated now so that its address is known; its bytes join the data ranges.
void create_checksum_table(hid_t file, std::int64_t checksum_rows, Skeleton& out, const Where& w) {
  const Dataset table{checksums_set, DType::u64, {checksum_rows}};
  Hid set = create_dataset(file, table, w);
  if (checksum_rows > 0) {
    const haddr_t addr = H5Dget_offset(set.get());
    require(addr != HADDR_UNDEF, Errc::hdf5, "HDF5 did not allocate the checksum table of ", w.file.string());
    out.checksums_address = addr;
    const auto begin = static_cast<std::int64_t>(addr);
    out.data.push_back({begin, begin + checksum_rows * static_cast<std::int64_t>(sizeof(std::uint64_t))});
  }
  set.close(w);
}

// A dataset's attributes: where a local file's dataset lies in its global tensor, and (in `slabs`,
// when the file is checksummed) its slab table.
void write_dataset_attrs(hid_t set, hid_t slabs, const Dataset& d, const Where& w) {
  if (d.placement) {
    const Box& b = d.placement->box;
    const std::int64_t box[] = {b.rows.begin, b.rows.end, b.cols.begin, b.cols.end};
    hdf5::write_attr(set, "global_key", std::string_view(d.placement->key), w);
    hdf5::write_attr(set, "global_shape", std::span<const std::int64_t>(d.placement->global_shape), 0, w);
    hdf5::write_attr(set, "global_box", std::span<const std::int64_t>(box), 0, w);
  }
  if (slabs >= 0 && !d.slabs.empty()) {
    std::vector<std::int64_t> table;
    table.reserve(d.slabs.size() * 5);
    for (const Slab& s : d.slabs)
      table.insert(table.end(), {s.box.rows.begin, s.box.rows.end, s.box.cols.begin, s.box.cols.end, s.first_checksum});
    hdf5::write_attr(slabs, d.key.c_str(), std::span<const std::int64_t>(table), 5, w);
  }
}

// One tensor dataset, allocated: its raw regions and their byte ranges join the skeleton.
void create_tensor_dataset(hid_t file, hid_t slabs, const Dataset& d, Skeleton& out, const Where& w) {
  require_key(d.key);
  Hid set = create_dataset(file, d, w);
  write_dataset_attrs(set.get(), slabs, d, w);
  Hid type = hdf5::type_of(d.dtype);
  Dataset made{d.key, d.dtype, d.shape, d.placement};
  made.regions = raw_regions_of(set.get(), type.get(), d.shape, d.dtype, w);
  for (const RawRegion& e : made.regions) {
    const auto begin = static_cast<std::int64_t>(e.address);
    out.data.push_back({begin, begin + region_elements(e) * element_bytes(d.dtype)});
  }
  out.datasets.push_back(std::move(made));
  set.close(w);
}

// The order the datasets are allocated in the file: key order, except that the blocks of a fused
// parameter (a record with several blocks) follow one another in row order, from where the first of
// them comes in key order. A tensor of a whole fused weight (a read at TP 1) then lies in the file as
// in memory, one range of a mapping of the file (CheckpointReader::map): wherever HDF5 puts nothing
// between them, the blocks are adjacent, their sizes being multiples of the 4 KiB alignment.
std::vector<std::size_t> allocation_order(std::span<const Dataset> datasets, std::span<const ParamRecord> params) {
  constexpr std::size_t none = SIZE_MAX;
  std::map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < datasets.size(); ++i) index.emplace(datasets[i].key, i);
  std::vector<std::vector<std::size_t>> fused;            // each fused record's datasets, in row order
  std::vector<std::size_t> group(datasets.size(), none);  // a dataset's entry in `fused`
  for (const ParamRecord& r : params) {
    if (r.blocks.size() < 2) continue;
    std::vector<std::size_t> members;
    for (const Section& b : r.blocks)
      if (const auto it = index.find(block_key(r.key, b.name)); it != index.end() && group[it->second] == none)
        group[it->second] = fused.size(), members.push_back(it->second);
    fused.push_back(std::move(members));
  }
  std::vector<std::size_t> out;
  out.reserve(datasets.size());
  std::vector<bool> placed(datasets.size(), false);
  for (std::size_t i = 0; i < datasets.size(); ++i) {
    if (placed[i]) continue;
    if (group[i] == none) {
      out.push_back(i), placed[i] = true;
      continue;
    }
    for (std::size_t j : fused[group[i]]) out.push_back(j), placed[j] = true;
  }
  return out;
}

// About how many bytes of HDF5 metadata a checkpoint of `datasets` holds, a little more rather than
// less: object headers, links, attributes, the slab tables (measured on the bench's models: about
// 1.2 KiB per dataset with a key of 40 bytes and one slab). 0 (HDF5's own blocks) where no tensor's
// bytes are in the file (an adopted checkpoint, whose tensors are in the file it adopted): there is
// nothing for metadata to fall between, and the file stays as small as its metadata.
std::uint64_t metadata_estimate(std::span<const Dataset> datasets, const CheckpointContents& contents) {
  if (std::all_of(datasets.begin(), datasets.end(), [](const Dataset& d) { return d.external.has_value(); })) return 0;
  std::uint64_t bytes = std::uint64_t{16} << 10;
  for (const ParamRecord& r : contents.params) bytes += 128 + 2 * r.key.size() + 64 * r.blocks.size();
  for (const auto& [key, value] : contents.common) {
    const auto* text = std::get_if<std::string>(&value);
    bytes += 64 + key.size() + (text ? text->size() : 16);
  }
  for (const Dataset& d : datasets)
    bytes += 1536 + 4 * d.key.size() + 48 * d.slabs.size() + 16 * d.shape.size() +
             (d.placement ? 256 + d.placement->key.size() : 0);
  return std::min<std::uint64_t>(bytes, std::uint64_t{64} << 20);
}

}  // namespace

Skeleton create_skeleton(io::File& f, std::span<const Dataset> datasets, const CheckpointContents& contents,
                         std::int64_t checksum_rows, bool shared) {
  require(checksum_rows >= 0 && (contents.checksummed || checksum_rows == 0), Errc::internal, "a checksum count of ", checksum_rows);
  const fs::path& partial = f.path();
  const Where w{partial, "", "create the checkpoint"};
  hdf5::Channel channel(f);
  Skeleton out;
  const std::vector<std::size_t> order = allocation_order(datasets, contents.params);
  {
    Hid file = hdf5::create_file(channel, metadata_estimate(datasets, contents));
    write_metadata(file.get(), contents, w);
    if (contents.checksummed) create_checksum_table(file.get(), checksum_rows, out, w);
    Hid slabs = contents.checksummed ? hdf5::create_group(file.get(), slabs_group, w) : Hid();
    out.datasets.reserve(datasets.size());
    for (std::size_t i : order) {
      const Dataset& d = datasets[i];
      create_tensor_dataset(file.get(), slabs ? slabs.get() : hid_t{-1}, d, out, {partial, d.key, "create the dataset"});
    }
    if (slabs) slabs.close(w);
    hdf5::close_written(file, channel, "create the checkpoint");
  }
  if (shared) f.sync();
  // In the order they were given (key order, as a skeleton lists them), not the file's.
  std::vector<Dataset> made(datasets.size());
  for (std::size_t k = 0; k < order.size(); ++k) made[order[k]] = std::move(out.datasets[k]);
  out.datasets = std::move(made);
  return out;
}

namespace {

// Where a writer's rows and checksums go: one of the two I/O strategies, chosen once per writer.
class PieceSink {
 public:
  virtual ~PieceSink() = default;
  // `rows` of `box` (a batch of a piece), row r at p + r * row_bytes.
  virtual void write(const Dataset& d, const Box& box, const std::byte* p, std::int64_t row_bytes) = 0;
  // Checksums [first, first + n) of the table.
  virtual void write_checksums(std::int64_t first, std::span<const std::uint64_t> hashes) = 0;
  // Everything written has reached the file (not yet stable storage).
  virtual void finish() = 0;
};

// Positional writes at the file addresses of the datasets' raw data, past HDF5: every rank at once.
// Small writes that continue one another in the file go out as one: a rank's part of a dataset
// banded past dim 1 (a layer-stacked row-parallel weight) is thousands of runs of a few KiB one after
// another in its chunk, and every write takes the file's inode lock (docs/performance.md).
class RawSink final : public PieceSink {
 public:
  RawSink(io::File& file, std::uint64_t table_address) : file_(file), table_address_(table_address) {}

  void write(const Dataset& d, const Box& box, const std::byte* p, std::int64_t row_bytes) override {
    require(!d.regions.empty(), Errc::invalid_argument, "key ", d.key,
            ": the raw path needs a dataset whose raw data it can address");
    transfer(file_.path(), d.regions, element_bytes(d.dtype), box, p, row_bytes,
             [&](const std::byte* q, std::size_t run, std::size_t rows, std::uint64_t at, std::int64_t file_stride) {
               if (static_cast<std::int64_t>(run) == file_stride && file_stride == row_bytes) return put(q, run * rows, at);
               for (std::size_t r = 0; r < rows; ++r)
                 put(q + r * row_bytes, run, at + r * static_cast<std::uint64_t>(file_stride));
             });
  }
  void write_checksums(std::int64_t first, std::span<const std::uint64_t> hashes) override {
    file_.pwrite_all(hashes.data(), hashes.size_bytes(),
                     table_address_ + static_cast<std::uint64_t>(first) * sizeof(std::uint64_t));
  }
  void finish() override {
    flush();
    pending_ = {};
  }

 private:
  // Writes under this many bytes are gathered, up to gather_bytes at a time: on this project's
  // machine 4 writers of one file wrote 1 GiB in 3 KiB runs in 1.7-1.9 s, in 128 KiB runs in 0.72 s,
  // in 1 MiB runs in 0.71 s. A writer holds at most gather_bytes more (1,024 thread ranks hold 128 MiB).
  static constexpr std::size_t gather_below = std::size_t{64} << 10, gather_bytes = std::size_t{128} << 10;

  // `n` bytes from `q` to `at`: written now, or copied to the pending ones (the caller's memory may
  // change once this returns).
  void put(const std::byte* q, std::size_t n, std::uint64_t at) {
    if (n >= gather_below) {
      file_.pwrite_all(q, n, at);
      return written(at, n);
    }
    if (!pending_.empty() && (pending_at_ + pending_.size() != at || pending_.size() + n > gather_bytes)) flush();
    if (pending_.empty()) pending_at_ = at;
    pending_.insert(pending_.end(), q, q + n);
  }
  void flush() {
    if (pending_.empty()) return;
    file_.pwrite_all(pending_.data(), pending_.size(), pending_at_);
    written(pending_at_, pending_.size());
    pending_.clear();
  }
  // Every writeback_bytes written, the kernel is asked to start writing the range of the file they
  // lie in to disk (io::File::start_writeback): the disk then works while this writer copies the
  // next ones, and the save's one sync at its end waits for the last of them only, where it would
  // otherwise write them all (measured on this project's machine, one process, medians of 15: 1 GiB
  // 2.15 s against 2.35 s without, 256 MiB 0.50 s against 0.57 s, 8 MiB 0.0225 s against 0.0255 s,
  // every 4 MiB; every 1 MiB, 8 MiB took 0.0199 s against 0.0215 s every 4 MiB, 256 MiB the same).
  static constexpr std::size_t writeback_bytes = std::size_t{1} << 20;
  void written(std::uint64_t at, std::size_t n) {
    if (unsynced_ == 0) low_ = at, high_ = at;
    low_ = std::min(low_, at), high_ = std::max(high_, at + n);
    unsynced_ += n;
    if (unsynced_ < writeback_bytes) return;
    unsynced_ = 0;
    file_.start_writeback(low_, high_);
  }
  std::size_t unsynced_ = 0;
  std::uint64_t low_ = 0, high_ = 0;  // the range of the file written since the last start_writeback

  io::File& file_;
  std::uint64_t table_address_;
  std::vector<std::byte> pending_;  // to be written at pending_at_
  std::uint64_t pending_at_ = 0;
};

// HDF5 hyperslab writes through the file's channel: one rank at a time (HDF5 must not have one file
// open for writing in two processes).
class Hdf5Sink final : public PieceSink {
 public:
  explicit Hdf5Sink(io::File& file) : path_(file.path()), channel_(file), h5_(hdf5::open_file(channel_, true, Errc::hdf5)) {}
  Hdf5Sink(const Hdf5Sink&) = delete;
  Hdf5Sink& operator=(const Hdf5Sink&) = delete;
  // An abandoned writer (its save failed): HDF5 objects close before the channel they use.
  ~Hdf5Sink() override {
    sets_.clear();
    h5_ = Hid();
  }

  void write(const Dataset& d, const Box& box, const std::byte* p, std::int64_t) override {
    const Where w{path_, d.key, "write a piece"};
    hdf5::write_box(dataset(d.key, w), d.dtype, d.shape, box, p, w);
  }
  void write_checksums(std::int64_t first, std::span<const std::uint64_t> hashes) override {
    const Where w{path_, "", "write the checksums"};
    const auto n = static_cast<std::int64_t>(hashes.size());
    const std::int64_t total = hdf5::shape_of(dataset(checksums_set, w), w, Errc::hdf5).at(0);
    require(first + n <= total, Errc::internal, "checksums past the end of the table");
    hdf5::write_box(dataset(checksums_set, w), DType::u64, std::vector<std::int64_t>{total},
                    {{first, first + n}, {0, 1}}, hashes.data(), w);
  }
  void finish() override {
    for (auto& [key, set] : sets_) set.close({path_, key, "write a piece"});
    sets_.clear();
    hdf5::close_written(h5_, channel_, "write pieces");
  }

 private:
  hid_t dataset(const std::string& key, const Where& w) {
    auto it = sets_.find(key);
    if (it == sets_.end())
      it = sets_.emplace(key, owned(H5Dopen2(h5_.get(), key.c_str(), H5P_DEFAULT), H5Dclose, w)).first;
    return it->second.get();
  }

  fs::path path_;
  hdf5::Channel channel_;
  Hid h5_;
  std::map<std::string, Hid, std::less<>> sets_;
};

}  // namespace

struct PieceWriter::Impl {
  Impl(io::File& f, IoMethod method, std::optional<ChecksumSlot> slot)
      : file(f),
        checksums(slot),
        sink(method == IoMethod::raw ? std::unique_ptr<PieceSink>(new RawSink(f, slot ? slot->table_address : 0))
                                     : std::unique_ptr<PieceSink>(new Hdf5Sink(f))) {}
  io::File& file;
  std::optional<ChecksumSlot> checksums;
  std::unique_ptr<PieceSink> sink;
  std::vector<std::uint64_t> hashes;  // not yet in the table
  std::int64_t hashes_written = 0;    // checksums of this writer already in the table
  BytesDone progress;
  bool sync_at_finish = true;  // false: the seal syncs the file (CheckpointWriter::pieces)
  // Rows that lie in a mapping of a file are copied here first (io::copy_guarded) and written from
  // here: a file cut short under the mapping is then Errc::replaced naming it, not SIGBUS.
  std::vector<std::byte> bounce;
  std::vector<std::uint64_t> batch_hashes;  // the checksums of the batch being written (hash_batch at most)

  // The checksums computed so far go to their place in the table: a writer holds at most
  // hash_batch of them, whatever the number of rows it writes.
  static constexpr std::size_t hash_batch = 8192;
  void flush_hashes() {
    if (hashes.empty()) return;
    sink->write_checksums(checksums->first_checksum + hashes_written, hashes);
    hashes_written += static_cast<std::int64_t>(hashes.size());
    hashes.clear();
  }
};

PieceWriter::PieceWriter(io::File& file, IoMethod method, std::optional<ChecksumSlot> checksums, BytesDone progress)
    : impl_(std::make_unique<Impl>(file, method, checksums)) {
  impl_->progress = std::move(progress);
}

void PieceWriter::leave_sync_to_the_seal() { impl_->sync_at_finish = false; }

PieceWriter::PieceWriter(PieceWriter&&) noexcept = default;
PieceWriter& PieceWriter::operator=(PieceWriter&&) noexcept = default;
PieceWriter::~PieceWriter() = default;

void PieceWriter::write(const Dataset& d, const Box& box, TensorView src) {
  Impl& m = *impl_;
  check_box(d, box, src.dtype(), src.bytes(), m.file.path());
  if (box.empty()) return;
  const std::int64_t row_bytes = box.cols.size() * element_bytes(d.dtype);
  const auto* bytes = static_cast<const std::byte*>(static_cast<const void*>(src.data()));
  // With checksums a batch is at most hash_batch rows, so that its checksums (Impl::batch_hashes)
  // take at most 64 KiB whatever the rows' width (a 1-D tensor's rows are single elements).
  const std::int64_t step = m.checksums ? std::min<std::int64_t>(batch_rows(row_bytes), Impl::hash_batch)
                                        : batch_rows(row_bytes);
  const auto row_n = static_cast<std::size_t>(row_bytes);
  for (std::int64_t r0 = box.rows.begin; r0 < box.rows.end; r0 += step) {
    const Box batch{{r0, std::min(r0 + step, box.rows.end)}, box.cols};
    const std::byte* p = bytes + (r0 - box.rows.begin) * row_bytes;
    const auto rows = static_cast<std::size_t>(batch.rows.size());
    const auto n = rows * row_n;
    // Rows that lie in a mapping of a file (a tensor a load mapped, as reshard writes them) are
    // written from a guarded copy (Impl::bounce).
    const bool copied = io::in_mapping(p, n);
    if (copied) {
      if (m.bounce.size() < n) m.bounce.resize(n);
      io::copy_guarded(m.bounce.data(), p, n);
      p = m.bounce.data();
    }
    // Each row's checksum is taken before the batch is written and, for rows in the caller's memory,
    // again after: a row that changed meanwhile (another thread of the caller writing the tensor)
    // fails the save, so that the checksums describe the bytes in the file. Hashing the rows twice
    // costs less than copying them once (the batch is still in cache).
    if (m.checksums) {
      m.batch_hashes.resize(rows);
      for (std::size_t r = 0; r < rows; ++r) m.batch_hashes[r] = row_hash(p + r * row_n, row_n);
    }
    m.sink->write(d, batch, p, row_bytes);
    if (m.checksums) {
      for (std::size_t r = 0; r < rows; ++r) {
        if (!copied && row_hash(p + r * row_n, row_n) != m.batch_hashes[r])
          throw Error(Errc::shard_changed,
                      cat("key ", d.key, ": row ", r0 + static_cast<std::int64_t>(r), " (of rows [",
                          box.rows.begin, ", ", box.rows.end, ")) changed while the save wrote it into ",
                          m.file.path().string(), ": another thread wrote the tensor during the save; nothing is "
                          "committed"));
        m.hashes.push_back(m.batch_hashes[r]);
        if (m.hashes.size() == Impl::hash_batch) m.flush_hashes();
      }
    }
    if (m.progress) m.progress(batch.rows.size() * row_bytes);
  }
}

void PieceWriter::write(const Dataset& d, std::span<const std::int64_t> offset,
                        std::span<const std::int64_t> count, TensorView src) {
  write(d, box_of(d, offset, count), src);
}

PiecesWritten PieceWriter::finish() {
  Impl& m = *impl_;
  m.flush_hashes();
  m.sink->finish();
  if (m.sync_at_finish) m.file.sync();
  return PiecesWritten(m.file);
}

void mark_complete(io::File& f, std::span<const Range> data) {
  const Where w{f.path(), "", "mark the checkpoint complete"};
  hdf5::Channel channel(f);
  {
    Hid file = hdf5::open_file(channel, true, Errc::hdf5);
    Hid meta = owned(H5Gopen2(file.get(), meta_group, H5P_DEFAULT), H5Gclose, w);
    hdf5::write_attr(meta.get(), "complete", std::int64_t{1}, w);
    meta.close(w);
    hdf5::close_written(file, channel, "mark the checkpoint complete");
  }
  write_seal(f, data);
  f.sync();
}

// What every step of a CheckpointWriter holds, on the heap so that a PieceWriter over its file
// stays valid while the steps move.
struct CheckpointState {
  io::TemporaryFile temp;
  Skeleton skeleton;
};

namespace {

CheckpointState& state_of(const std::unique_ptr<CheckpointState>& state, std::string_view step) {
  require(state != nullptr, Errc::invalid_argument, "a checkpoint step taken on a checkpoint that has moved on (",
          step, "): each step consumes the one before");
  return *state;
}

}  // namespace

CheckpointWriter CheckpointWriter::create(io::Destination dest, std::span<const Dataset> datasets,
                                          const CheckpointContents& contents, std::int64_t checksum_rows, bool shared) {
  io::TemporaryFile temp = io::TemporaryFile::create(std::move(dest));
  Skeleton skeleton = create_skeleton(temp.file(), datasets, contents, checksum_rows, shared);
  return CheckpointWriter(std::make_unique<CheckpointState>(std::move(temp), std::move(skeleton)));
}

CheckpointWriter::CheckpointWriter(std::unique_ptr<CheckpointState> state) noexcept : state_(std::move(state)) {}
CheckpointWriter::CheckpointWriter(CheckpointWriter&&) noexcept = default;
CheckpointWriter& CheckpointWriter::operator=(CheckpointWriter&&) noexcept = default;
CheckpointWriter::~CheckpointWriter() = default;

const Skeleton& CheckpointWriter::skeleton() const { return state_of(state_, "skeleton").skeleton; }
const io::TemporaryFile& CheckpointWriter::temporary() const { return state_of(state_, "temporary").temp; }

PieceWriter CheckpointWriter::pieces(IoMethod method, std::optional<std::int64_t> first_checksum, BytesDone progress) {
  CheckpointState& s = state_of(state_, "pieces");
  std::optional<ChecksumSlot> slot;
  if (first_checksum) slot = ChecksumSlot{s.skeleton.checksums_address, *first_checksum};
  PieceWriter out(s.temp.file(), method, slot, std::move(progress));
  out.impl_->sync_at_finish = false;  // its pieces reach stable storage with the seal's sync of this file
  return out;
}

PiecesWritten CheckpointWriter::write_checksums(std::span<const std::uint64_t> hashes) {
  CheckpointState& s = state_of(state_, "write_checksums");
  if (!hashes.empty()) s.temp.file().pwrite_all(hashes.data(), hashes.size_bytes(), s.skeleton.checksums_address);
  s.temp.file().sync();
  return PiecesWritten(s.temp.file());
}

WrittenCheckpoint CheckpointWriter::written(PiecesWritten done) && {
  CheckpointState& s = state_of(state_, "written");
  require(done.file_ == &s.temp.file(), Errc::invalid_argument,
          "the pieces written are of another file than the checkpoint ", s.temp.destination().shown);
  return WrittenCheckpoint(std::move(state_));
}

WrittenCheckpoint::WrittenCheckpoint(std::unique_ptr<CheckpointState> state) noexcept : state_(std::move(state)) {}
WrittenCheckpoint::WrittenCheckpoint(WrittenCheckpoint&&) noexcept = default;
WrittenCheckpoint& WrittenCheckpoint::operator=(WrittenCheckpoint&&) noexcept = default;
WrittenCheckpoint::~WrittenCheckpoint() = default;

SealedCheckpoint WrittenCheckpoint::seal() && {
  CheckpointState& s = state_of(state_, "seal");
  s.temp.take_destination_mode();  // synced with the seal below, not on its own at the commit
  mark_complete(s.temp.file(), s.skeleton.data);
  return SealedCheckpoint(std::move(state_));
}

SealedCheckpoint::SealedCheckpoint(std::unique_ptr<CheckpointState> state) noexcept : state_(std::move(state)) {}
SealedCheckpoint::SealedCheckpoint(SealedCheckpoint&&) noexcept = default;
SealedCheckpoint& SealedCheckpoint::operator=(SealedCheckpoint&&) noexcept = default;
SealedCheckpoint::~SealedCheckpoint() = default;

void SealedCheckpoint::commit() && {
  state_of(state_, "commit").temp.commit();
  state_.reset();
}

}  // namespace shardckpt
