// shardckpt.storage:records (implementation partition): the names of the library's metadata in the
// file, the rule for keys, parameter records as JSON, and the check of records against datasets.
// It never accepts a record it has not checked field by field.
module;
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>
module shardckpt.storage:records;
import shardckpt.core;
import shardckpt.layout;
import :format;

namespace shardckpt {

constexpr const char* meta_group = "_shardckpt";
constexpr const char* common_group = "_shardckpt/common";
constexpr const char* slabs_group = "_shardckpt/slabs";
constexpr const char* checksums_set = "_shardckpt/checksums";
// The checksum scheme, recorded so that a future one is refused rather than misread.
constexpr std::string_view checksum_scheme = "xxh3-64 of each row of each slab";
constexpr std::string_view no_checksums = "none";

// Throws Errc::invalid_argument unless `key` can name a dataset at the root (or, as `what` says,
// a common value: an attribute of /_shardckpt/common).
void require_key(std::string_view key, std::string_view what = "a dataset");

// Parameter records as the `params` attribute holds them (records_json in :tools writes them):
// strict (every field present with its JSON type, integers in the int64 range, nothing nested deeper
// than records need), then each record is planned once, which checks its geometry. Throws
// std::exception for text that is not.
std::vector<ParamRecord> params_from_json(std::string_view text);

// Checks parameter records against the datasets they name: every block a dataset of the block's
// shape, no dataset named twice, one dtype per parameter. `find(key)` gives a dataset (or throws);
// `bad(record, why)` throws for a contradiction.
template <class Find, class Bad>
void check_records(const std::vector<ParamRecord>& records, Find&& find, Bad&& bad) {
  std::set<std::string> covered;
  for (const ParamRecord& r : records) {
    std::optional<DType> dtype;
    for (const Section& b : r.blocks) {
      const std::string key = block_key(r.key, b.name);
      if (!covered.insert(key).second) bad(r, cat("names dataset ", key, ", which another record names too"));
      const Dataset* d = nullptr;
      try {
        d = &find(key);
      } catch (const Error& e) {
        bad(r, cat("names dataset ", key, ": ", e.what()));
      }
      std::vector<std::int64_t> want{b.rows};
      want.insert(want.end(), r.trailing.begin(), r.trailing.end());
      if (d->shape != want)
        bad(r, cat("says block ", key, " has shape ", dims_text(want), " but the dataset has ", dims_text(d->shape)));
      if (dtype && *dtype != d->dtype) bad(r, "has blocks of different dtypes");
      dtype = d->dtype;
    }
  }
}

}  // namespace shardckpt
