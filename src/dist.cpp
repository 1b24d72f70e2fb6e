module;
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.dist;
import shardckpt.layout;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Bytes = std::vector<std::byte>;

Bytes to_bytes(const json& j) {
  const std::vector<std::uint8_t> packed = json::to_msgpack(j);
  Bytes out(packed.size());
  std::memcpy(out.data(), packed.data(), packed.size());
  return out;
}

json from_bytes(std::span<const std::byte> b) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(b.data());
  return json::from_msgpack(p, p + b.size());
}

// One phase of a collective operation: every rank runs `step`, then all ranks exchange outcomes.
// Either every rank gets every rank's payload, or every rank throws the same error: the code of the
// lowest failing rank and the messages of the failing ranks.
std::vector<json> agree(ProcessGroup& group, std::string_view phase, const std::function<json()>& step) {
  json mine;
  try {
    mine = {{"ok", true}, {"payload", step()}};
  } catch (const Error& e) {
    mine = {{"ok", false}, {"code", static_cast<int>(e.code())}, {"message", e.what()}};
  } catch (const std::exception& e) {
    mine = {{"ok", false}, {"code", static_cast<int>(Errc::internal)}, {"message", e.what()}};
  }
  const auto gathered = group.all_gather(to_bytes(mine));
  std::vector<json> payloads;
  std::optional<Errc> code;
  std::string text;
  for (std::size_t r = 0; r < gathered.size(); ++r) {
    json j = from_bytes(gathered[r]);
    if (j.at("ok").get<bool>()) {
      payloads.push_back(std::move(j.at("payload")));
      continue;
    }
    text += cat(code ? "; and on rank " : " failed on rank ", r, ": ", j.at("message").get<std::string>());
    if (!code) code = static_cast<Errc>(j.at("code").get<int>());
  }
  if (code) throw Error(*code, cat(phase, text));
  return payloads;
}

json claim_json(const Claim& c) {
  return {c.key, static_cast<int>(c.dtype), c.global_shape, c.global_offset, c.count, c.main_replica};
}

Claim claim_from(const json& j, int rank) {
  return {j[0].get<std::string>(),
          static_cast<DType>(j[1].get<int>()),
          j[2].get<std::vector<std::int64_t>>(),
          j[3].get<std::vector<std::int64_t>>(),
          j[4].get<std::vector<std::int64_t>>(),
          rank,
          j[5].get<bool>()};
}

json common_json(const std::map<std::string, CommonValue, std::less<>>& common) {
  json out = json::object();
  for (const auto& [key, value] : common) std::visit([&](const auto& v) { out[key] = v; }, value);
  return out;
}

CommonValue common_from(const json& j) {
  if (j.is_number_integer()) return j.get<std::int64_t>();
  if (j.is_number()) return j.get<double>();
  return j.get<std::string>();
}

json record_json(const ParamRecord& r) {
  json blocks = json::array();
  for (const Section& s : r.blocks) blocks.push_back({s.name, s.rows});
  return {r.key, static_cast<int>(r.tp_axis), blocks, r.trailing};
}

ParamRecord record_from(const json& j) {
  ParamRecord r{
      j[0].get<std::string>(), static_cast<TpAxis>(j[1].get<int>()), {}, j[3].get<std::vector<std::int64_t>>()};
  for (const json& b : j[2]) r.blocks.push_back({b[0].get<std::string>(), b[1].get<std::int64_t>()});
  return r;
}

json dataset_json(const DatasetInfo& d) {
  return {d.key, static_cast<int>(d.dtype), d.shape, d.address ? json(*d.address) : json()};
}

DatasetInfo dataset_from(const json& j) {
  DatasetInfo d{j[0].get<std::string>(),
                static_cast<DType>(j[1].get<int>()),
                j[2].get<std::vector<std::int64_t>>(),
                std::nullopt,
                std::nullopt,
                false};
  if (!j[3].is_null()) d.address = j[3].get<std::uint64_t>();
  return d;
}

}  // namespace

std::vector<std::vector<std::byte>> SoloGroup::all_gather(std::span<const std::byte> mine) {
  return {Bytes(mine.begin(), mine.end())};
}

std::vector<std::byte> SoloGroup::broadcast(std::span<const std::byte> bytes, int root) {
  require(root == 0, Errc::invalid_argument, "broadcast root ", root, " is outside a group of 1");
  return {bytes.begin(), bytes.end()};
}

// Rendezvous of all ranks per collective: the last rank to arrive publishes the round's result and
// bumps the generation that the others wait on.
struct ThreadGroup::State {
  struct Member final : ProcessGroup {
    State* state = nullptr;
    int me = 0;
    int rank() const override { return me; }
    int size() const override { return static_cast<int>(state->members.size()); }
    void barrier() override { (void)all_gather({}); }
    std::vector<Bytes> all_gather(std::span<const std::byte> mine) override { return state->exchange(me, mine); }
    Bytes broadcast(std::span<const std::byte> bytes, int root) override {
      require(root >= 0 && root < size(), Errc::invalid_argument, "broadcast root ", root, " is outside a group of ",
              size());
      return std::move(
          state->exchange(me, me == root ? bytes : std::span<const std::byte>())[static_cast<std::size_t>(root)]);
    }
  };

  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Member> members;
  std::vector<Bytes> slots, result;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::optional<std::string> aborted;

  void throw_if_aborted() const {
    if (aborted) throw Error(Errc::collective, cat("the thread group was aborted: ", *aborted));
  }

  std::vector<Bytes> exchange(int rank, std::span<const std::byte> mine) {
    std::unique_lock lock(mutex);
    throw_if_aborted();
    slots[static_cast<std::size_t>(rank)].assign(mine.begin(), mine.end());
    if (++arrived == static_cast<int>(members.size())) {
      result = std::move(slots);
      slots.assign(members.size(), {});
      arrived = 0;
      ++generation;
      changed.notify_all();
      return result;
    }
    const std::uint64_t round = generation;
    changed.wait(lock, [&] { return generation != round || aborted; });
    if (generation == round) throw_if_aborted();
    // The next round cannot complete without this rank, so `result` still holds this round's.
    return result;
  }
};

ThreadGroup::ThreadGroup(int size) : state_(std::make_unique<State>()) {
  require(size >= 1, Errc::invalid_argument, "a thread group needs at least one rank (got ", size, ")");
  state_->members.resize(static_cast<std::size_t>(size));
  state_->slots.resize(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    state_->members[static_cast<std::size_t>(r)].state = state_.get();
    state_->members[static_cast<std::size_t>(r)].me = r;
  }
}

ThreadGroup::~ThreadGroup() = default;

int ThreadGroup::size() const noexcept { return static_cast<int>(state_->members.size()); }

ProcessGroup& ThreadGroup::member(int rank) {
  require(rank >= 0 && rank < size(), Errc::invalid_argument, "rank ", rank, " is outside a thread group of ", size());
  return state_->members[static_cast<std::size_t>(rank)];
}

void ThreadGroup::abort(const std::string& reason) {
  const std::lock_guard lock(state_->mutex);
  if (!state_->aborted) state_->aborted = reason;
  state_->changed.notify_all();
}

void run_ranks(int ranks, const std::function<void(ProcessGroup&)>& fn) {
  ThreadGroup group(ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(group.member(r));
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        group.abort(cat("rank ", r, " failed: ", e.what()));
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        group.abort(cat("rank ", r, " failed"));
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

void save(const StateDict& state, const fs::path& path, ProcessGroup& group, SaveOptions options) {
  const ForbidMaterialization no_copies;
  const int me = group.rank();
  const fs::path partial = partial_path(path);
  try {
    SavePlan plan;
    // 1. Every rank's plan, to every rank.
    const std::vector<json> shared = agree(group, "planning the save", [&] {
      plan = prepare_save(state);
      json claims = json::array(), records = json::array();
      for (const Claim& c : claims_of(plan, me)) claims.push_back(claim_json(c));
      for (const ParamRecord& r : plan.params) records.push_back(record_json(r));
      return json{
          {"claims", claims}, {"params", records}, {"common", me == 0 ? common_json(plan.common) : json::object()}};
    });
    // 2. Validation of all plans together, before anything touches the disk. It is deterministic,
    // so every rank reaches the same verdict; agree() still makes a rank's surprise everyone's.
    std::vector<Claim> claims;
    CheckpointContents contents;
    agree(group, "validating the plans of all ranks", [&] {
      std::map<std::string, ParamRecord> records;
      for (std::size_t r = 0; r < shared.size(); ++r) {
        for (const json& c : shared[r].at("claims")) claims.push_back(claim_from(c, static_cast<int>(r)));
        for (const json& j : shared[r].at("params")) {
          ParamRecord rec = record_from(j);
          const auto [it, fresh] = records.emplace(rec.key, rec);
          require(fresh || it->second == rec, Errc::shape_mismatch, "parameter ", rec.key, ": rank ", r,
                  " describes its blocks differently from another rank");
        }
      }
      validate_claims(claims);
      for (auto& [key, rec] : records) contents.params.push_back(std::move(rec));
      for (const auto& [key, value] : shared[0].at("common").items()) contents.common.emplace(key, common_from(value));
      return json();
    });
    // 3. Rank 0 creates the file with every dataset at its global shape; all learn the addresses.
    const std::vector<json> created = agree(group, "creating the checkpoint", [&] {
      json out = json::array();
      if (me == 0)
        for (const DatasetInfo& d : create_skeleton(partial, datasets_of(claims), contents))
          out.push_back(dataset_json(d));
      return out;
    });
    std::vector<DatasetInfo> datasets;
    for (const json& d : created[0]) datasets.push_back(dataset_from(d));
    // 4. Every rank writes its own pieces: all at once on the direct path; on the hyperslab path
    // one rank at a time, since HDF5 must not have one file open for writing in two processes.
    auto write_mine = [&] {
      PieceWriter writer(partial, options.method);
      write_items(plan, datasets, writer);
      writer.finish();
      return json();
    };
    if (options.method == IoMethod::direct) {
      agree(group, "writing pieces", write_mine);
    } else {
      for (int turn = 0; turn < group.size(); ++turn)
        agree(group, "writing pieces", [&] { return turn == me ? write_mine() : json(); });
    }
    // 5. Only when every rank has written and synced its pieces does rank 0 commit.
    agree(group, "committing the checkpoint", [&] {
      if (me == 0) {
        mark_complete(partial);
        commit(partial, path);
      }
      return json();
    });
  } catch (Error& e) {
    // Nothing was committed; whatever rank 0 had created goes.
    if (me == 0) discard(partial);
    throw std::move(e.add_context(cat("saving ", path.string())));
  }
}

void save(const StateDict& state, const fs::path& path, SaveOptions options) {
  SoloGroup solo;
  save(state, path, solo, options);
}

LoadedState load(const fs::path& path, const StateDict& request, ProcessGroup& group, LoadOptions options) {
  std::optional<LoadedState> out;
  agree(group, cat("loading ", path.string()), [&] {
    out.emplace(load(path, request, options));
    return json();
  });
  return std::move(*out);
}

}  // namespace shardckpt
