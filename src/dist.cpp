module;
#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.dist;
import shardckpt.layout;
import shardckpt.storage;

namespace shardckpt {

// The library's own use of the groups' metadata collectives, which users do not call.
struct Protocol {
  static std::vector<std::vector<std::byte>> all_gather(ProcessGroup& g, std::span<const std::byte> mine) {
    return g.all_gather(mine);
  }
  static std::vector<std::vector<std::byte>> gather(ProcessGroup& g, std::span<const std::byte> mine, int root) {
    return g.gather(mine, root);
  }
};

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<std::byte>;

// ---- the wire format of the save protocol: little structs as length-prefixed binary ------------------

class Writer {
 public:
  void u8(std::uint8_t v) { out_.push_back(static_cast<std::byte>(v)); }
  void i64(std::int64_t v) { put(&v, sizeof v); }
  void f64(double v) { put(&v, sizeof v); }
  void str(std::string_view s) {
    i64(static_cast<std::int64_t>(s.size()));
    put(s.data(), s.size());
  }
  void dims(std::span<const std::int64_t> v) {
    i64(static_cast<std::int64_t>(v.size()));
    put(v.data(), v.size() * sizeof(std::int64_t));
  }
  void bytes(std::span<const std::byte> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  Bytes take() { return std::move(out_); }

 private:
  void put(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  Bytes out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(*take(1).data()); }
  std::int64_t i64() { return get<std::int64_t>(); }
  double f64() { return get<double>(); }
  std::string str() {
    const auto b = take(length());
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  std::vector<std::int64_t> dims() {
    std::vector<std::int64_t> v(length());
    const auto b = take(v.size() * sizeof(std::int64_t));
    if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
    return v;
  }
  std::span<const std::byte> rest() { return take(in_.size() - pos_); }

 private:
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof v).data(), sizeof v);
    return v;
  }
  std::size_t length() {
    const std::int64_t n = i64();
    require(n >= 0 && static_cast<std::size_t>(n) <= in_.size() - pos_, Errc::collective, "a malformed message");
    return static_cast<std::size_t>(n);
  }
  std::span<const std::byte> take(std::size_t n) {
    require(n <= in_.size() - pos_, Errc::collective, "a truncated message");
    const auto out = in_.subspan(pos_, n);
    pos_ += n;
    return out;
  }
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

// A step's outcome as sent to other ranks: 1 and the payload, or 0, the error code and the message.
Bytes outcome(const std::function<Bytes()>& step) {
  const auto failure = [](Errc code, std::string_view what) {
    Writer w;
    w.u8(0);
    w.u8(static_cast<std::uint8_t>(code));
    w.str(what);
    return w.take();
  };
  try {
    const Bytes payload = step();
    Bytes out;  // sized once: a rank's planning payload is gathered at rank 0 with every other's
    out.reserve(payload.size() + 1);
    out.push_back(std::byte{1});
    out.insert(out.end(), payload.begin(), payload.end());
    return out;
  } catch (const Error& e) {
    return failure(e.code(), e.what());
  } catch (const std::bad_alloc& e) {
    return failure(Errc::resources, cat("out of memory (", e.what(), ")"));
  } catch (const std::system_error& e) {
    return failure(e.code() == std::errc::resource_unavailable_try_again ? Errc::resources : Errc::internal, e.what());
  } catch (const std::exception& e) {
    return failure(Errc::internal, e.what());
  }
}

// The payload of one outcome, or its error rethrown as it was.
std::span<const std::byte> payload_or_throw(std::span<const std::byte> bytes) {
  Reader r(bytes);
  if (r.u8() == 1) return r.rest();
  const auto code = static_cast<Errc>(r.u8());
  throw Error(code, r.str());
}

// Every rank's payload, or one error for all: the code of the lowest failing rank and the message
// of every failing rank.
// Ranks that failed with the same message are named together, so that a failure every rank shares
// reads once.
std::vector<std::span<const std::byte>> payloads_or_throw(std::string_view phase, const std::vector<Bytes>& outcomes) {
  std::vector<std::span<const std::byte>> payloads;
  std::optional<Errc> code;
  std::vector<std::pair<std::string, std::vector<std::size_t>>> failures;  // message, ranks, in rank order
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    try {
      payloads.push_back(payload_or_throw(outcomes[r]));
    } catch (const Error& e) {
      if (!code) code = e.code();
      const auto same = std::find_if(failures.begin(), failures.end(), [&](const auto& f) { return f.first == e.what(); });
      if (same == failures.end())
        failures.emplace_back(e.what(), std::vector<std::size_t>{r});
      else
        same->second.push_back(r);
    }
  }
  if (!code) return payloads;
  std::string text;
  for (const auto& [message, ranks] : failures) {
    text += text.empty() ? " failed on rank" : "; and on rank";
    text += ranks.size() > 1 ? "s " : " ";
    for (std::size_t i = 0; i < ranks.size(); ++i) text += cat(i ? ", " : "", ranks[i]);
    text += cat(": ", message);
  }
  throw Error(*code, cat(phase, text));
}

// One phase on all ranks: every rank runs `step`, all exchange outcomes, and either every rank gets
// every payload or every rank throws the same error.
void agree(ProcessGroup& group, std::string_view phase, const std::function<void()>& step) {
  (void)payloads_or_throw(phase, Protocol::all_gather(group, outcome([&] {
    step();
    return Bytes();
  })));
}

// One phase decided by rank 0: every rank runs `step`, rank 0 alone sees all payloads and runs
// `decide` on them, and every rank gets rank 0's verdict: its payload, or the same error.
Bytes decide_at_root(ProcessGroup& group, std::string_view phase, const std::function<Bytes()>& step,
                     const std::function<Bytes(const std::vector<std::span<const std::byte>>&)>& decide) {
  const std::vector<Bytes> gathered = Protocol::gather(group, outcome(step), 0);
  Bytes verdict;
  if (group.rank() == 0)
    verdict = outcome([&] {
      const auto payloads = payloads_or_throw(phase, gathered);
      try {
        return decide(payloads);
      } catch (Error& e) {
        throw std::move(e.add_context(cat(phase, " failed on rank 0")));
      }
    });
  const Bytes shared = group.broadcast(verdict, 0);
  const auto payload = payload_or_throw(shared);
  return {payload.begin(), payload.end()};
}

void put_box(Writer& w, const Box& b) {
  for (std::int64_t v : {b.rows.begin, b.rows.end, b.cols.begin, b.cols.end}) w.i64(v);
}

Box get_box(Reader& r) {
  Box b;
  b.rows.begin = r.i64();
  b.rows.end = r.i64();
  b.cols.begin = r.i64();
  b.cols.end = r.i64();
  return b;
}

void put_claim(Writer& w, const SaveItem& i) {
  w.str(i.key);
  w.u8(static_cast<std::uint8_t>(i.dtype));
  w.dims(i.global_shape);
  put_box(w, i.box);
  w.u8(i.writes);
}

Claim get_claim(Reader& r, int rank) {
  Claim c;
  c.key = r.str();
  c.dtype = static_cast<DType>(r.u8());
  c.global_shape = r.dims();
  c.box = get_box(r);
  c.rank = rank;
  c.writes = r.u8() != 0;
  return c;
}

void put_record(Writer& w, const ParamRecord& p) {
  w.str(p.key);
  w.u8(static_cast<std::uint8_t>(p.tp_axis));
  w.i64(static_cast<std::int64_t>(p.blocks.size()));
  for (const Section& s : p.blocks) {
    w.str(s.name);
    w.i64(s.rows);
  }
  w.dims(p.trailing);
}

ParamRecord get_record(Reader& r) {
  ParamRecord p;
  p.key = r.str();
  p.tp_axis = static_cast<TpAxis>(r.u8());
  for (std::int64_t n = r.i64(); n > 0; --n) {
    std::string name = r.str();
    p.blocks.push_back({std::move(name), r.i64()});
  }
  p.trailing = r.dims();
  return p;
}

void put_common(Writer& w, const Values& common) {
  w.i64(static_cast<std::int64_t>(common.size()));
  for (const auto& [key, value] : common) {
    w.str(key);
    w.u8(static_cast<std::uint8_t>(value.index()));
    if (const auto* i = std::get_if<std::int64_t>(&value)) w.i64(*i);
    if (const auto* d = std::get_if<double>(&value)) w.f64(*d);
    if (const auto* s = std::get_if<std::string>(&value)) w.str(*s);
  }
}

Values get_common(Reader& r) {
  Values out;
  for (std::int64_t n = r.i64(); n > 0; --n) {
    std::string key = r.str();
    switch (r.u8()) {
      case 0:
        out.emplace(std::move(key), r.i64());
        break;
      case 1:
        out.emplace(std::move(key), r.f64());
        break;
      default:
        out.emplace(std::move(key), r.str());
        break;
    }
  }
  return out;
}

void put_dataset(Writer& w, const Dataset& d) {
  w.str(d.key);
  w.u8(static_cast<std::uint8_t>(d.dtype));
  w.dims(d.shape);
  w.i64(static_cast<std::int64_t>(d.regions.size()));
  for (const RawRegion& e : d.regions) {
    for (std::int64_t v : {e.box.rows.begin, e.box.rows.end, e.box.cols.begin, e.box.cols.end}) w.i64(v);
    w.i64(static_cast<std::int64_t>(e.address));
  }
}

Dataset get_dataset(Reader& r) {
  Dataset d;
  d.key = r.str();
  d.dtype = static_cast<DType>(r.u8());
  d.shape = r.dims();
  for (std::int64_t n = r.i64(); n > 0; --n) {
    RawRegion e;
    e.box.rows.begin = r.i64();
    e.box.rows.end = r.i64();
    e.box.cols.begin = r.i64();
    e.box.cols.end = r.i64();
    e.address = static_cast<std::uint64_t>(r.i64());
    d.regions.push_back(e);
  }
  return d;
}

// The datasets whose first element this rank writes: the one rank that sends a parameter's record
// is the one that writes the first element of its first block.
std::set<std::string_view> first_elements(const SavePlan& plan) {
  std::set<std::string_view> out;
  for (const SaveItem& i : plan.items)
    if (i.writes && !i.box.empty() && i.box.rows.begin == 0 && i.box.cols.begin == 0) out.insert(i.key);
  return out;
}

// Checksummed rows of a claim: writers checksum every row of their box.
std::int64_t claim_checksums(const Claim& c) { return c.writes ? checksum_rows_of(c.box) : 0; }
// Claims rank 0 turns into Claim values at a time. Claims of one key always fall into the same part,
// so checking the parts one by one checks everything, while the memory for Claim values stays near
// this many whatever the number of ranks and pieces (the seed's 159k claims would take 42 MiB).
constexpr std::int64_t claims_per_part = 16 * 1024;

// What rank 0 decides in planning: the datasets to create, and where each rank's checksums start.
struct Planned {
  std::vector<Dataset> specs;
  std::vector<std::int64_t> first_checksums;  // per rank
  std::int64_t checksum_rows = 0;
};

// Rank 0's side of planning: validates the claims of all ranks, part by part, lays out the checksum
// table (each rank's checksums follow the previous rank's, in the order of its claims), and collects
// the parameter records and rank 0's common values.
Planned validate_in_parts(const std::vector<std::span<const std::byte>>& payloads, CheckpointContents& contents) {
  Planned out;
  std::int64_t claims_total = 0;
  for (std::span<const std::byte> p : payloads) {
    Reader r(p);
    out.first_checksums.push_back(out.checksum_rows);
    out.checksum_rows = checked_add(out.checksum_rows, r.i64(), "checksum checksum_rows of all ranks");
    claims_total = checked_add(claims_total, r.i64(), "claims of all ranks");
  }
  const auto parts =
      static_cast<std::size_t>(std::max<std::int64_t>(1, (claims_total + claims_per_part - 1) / claims_per_part));
  std::map<std::string, ParamRecord, std::less<>> records;
  for (std::size_t part = 0; part < parts; ++part) {
    std::vector<Claim> claims;
    std::vector<std::int64_t> firsts;
    for (std::size_t rank = 0; rank < payloads.size(); ++rank) {
      Reader r(payloads[rank]);
      const std::int64_t checksum_rows = r.i64();
      std::int64_t running = 0;
      for (std::int64_t n = r.i64(); n > 0; --n) {
        Claim c = get_claim(r, static_cast<int>(rank));
        const std::int64_t u = claim_checksums(c);
        if (std::hash<std::string>{}(c.key) % parts == part) {
          firsts.push_back(out.first_checksums[rank] + running);
          claims.push_back(std::move(c));
        }
        running = checked_add(running, u, "checksum checksum_rows of a rank");
      }
      require(running == checksum_rows, Errc::internal, "rank ", rank, " announced ", checksum_rows, " checksum checksum_rows but claims ",
              running);
      if (part > 0) continue;
      for (std::int64_t n = r.i64(); n > 0; --n) {
        ParamRecord rec = get_record(r);
        records.emplace(rec.key, std::move(rec));
      }
      auto common = get_common(r);
      if (rank == 0) contents.common = std::move(common);
    }
    validate_claims(claims);
    for (Dataset& d : datasets_of(claims, firsts)) out.specs.push_back(std::move(d));
  }
  for (auto& [key, rec] : records) contents.params.push_back(std::move(rec));
  std::sort(out.specs.begin(), out.specs.end(),
            [](const Dataset& a, const Dataset& b) { return a.key < b.key; });
  return out;
}


// The outcome of a local check as a message, so that every member can learn every member's verdict.
Bytes checked(const std::function<void()>& check, Bytes payload) {
  return outcome([&] {
    check();
    return payload;
  });
}

}  // namespace

std::vector<std::vector<std::byte>> ProcessGroup::gather(std::span<const std::byte> mine, int root) {
  require_root(root, size());
  auto all = all_gather(mine);
  if (rank() != root) all.clear();
  return all;
}

void require_root(int root, int size) {
  require(root >= 0 && root < size, Errc::invalid_argument, "root ", root, " is outside a group of ", size);
}

void require_row_counts(TensorView rows, std::span<const std::int64_t> counts, int size) {
  require(counts.size() == static_cast<std::size_t>(size), Errc::invalid_argument, "gathering rows: ", counts.size(),
          " row counts for a group of ", size);
  std::int64_t total = 0;
  for (std::int64_t c : counts) {
    require(c >= 0, Errc::invalid_argument, "gathering rows: a negative row count (", c, ")");
    total = checked_add(total, c, "rows gathered");
  }
  require(total == rows.rows(), Errc::invalid_argument, "gathering rows: the counts add up to ", total,
          " rows but the tensor has ", rows.rows());
}

std::unique_ptr<ProcessGroup> SoloGroup::split(int, int) { return std::make_unique<SoloGroup>(); }

void SoloGroup::all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) {
  require_row_counts(rows, counts, 1);
}

std::vector<std::vector<std::byte>> SoloGroup::all_gather(std::span<const std::byte> mine) {
  return {Bytes(mine.begin(), mine.end())};
}

std::vector<std::byte> SoloGroup::broadcast(std::span<const std::byte> bytes, int root) {
  require_root(root, 1);
  return {bytes.begin(), bytes.end()};
}

// The rendezvous of a thread group's members, one collective at a time: the last member to arrive
// publishes the round's result and bumps the generation that the others wait on. Groups split from
// it are its children: an abort reaches them too.
struct ThreadGroup::Shared {
  explicit Shared(int size) : size(size), slots(static_cast<std::size_t>(size)) {}

  const int size;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Bytes> slots, result;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::optional<std::string> aborted;
  std::vector<std::weak_ptr<Shared>> children;
  // Groups being split off in one round, by (round, color): the group and how many members have yet
  // to take it.
  std::map<std::pair<std::uint64_t, int>, std::pair<std::shared_ptr<Shared>, int>> splitting;

  void abort(const std::string& reason) {
    std::vector<std::shared_ptr<Shared>> reached;
    {
      const std::lock_guard lock(mutex);
      if (!aborted) aborted = reason;
      changed.notify_all();
      for (const auto& c : children)
        if (auto child = c.lock()) reached.push_back(std::move(child));
    }
    for (const auto& child : reached) child->abort(reason);
  }

  void throw_if_aborted() const {
    if (aborted) throw Error(Errc::collective, cat("the thread group was aborted: ", *aborted));
  }

  // Deposits this member's bytes, waits for the round to complete, and returns pick(result, round)
  // for this member: everything, one member's bytes, or nothing.
  template <class Pick>
  auto exchange(int me, std::span<const std::byte> mine, Pick pick) {
    std::unique_lock lock(mutex);
    throw_if_aborted();
    slots[static_cast<std::size_t>(me)].assign(mine.begin(), mine.end());
    if (++arrived == size) {
      result = std::move(slots);
      slots.assign(static_cast<std::size_t>(size), {});
      arrived = 0;
      ++generation;
      changed.notify_all();
      return pick(result, generation);
    }
    const std::uint64_t round = generation;
    changed.wait(lock, [&] { return generation != round || aborted; });
    if (generation == round) throw_if_aborted();
    // The next round cannot complete without this member, so `result` still holds this round's.
    return pick(result, round + 1);
  }

  // The group of `color` split off in `round`, made by the first of its `members` to ask.
  std::shared_ptr<Shared> child(std::uint64_t round, int color, int members) {
    const std::lock_guard lock(mutex);
    throw_if_aborted();
    auto [it, fresh] = splitting.try_emplace({round, color});
    if (fresh) {
      it->second = {std::make_shared<Shared>(members), members};
      std::erase_if(children, [](const std::weak_ptr<Shared>& c) { return c.expired(); });
      children.push_back(it->second.first);
    }
    std::shared_ptr<Shared> out = it->second.first;
    if (--it->second.second == 0) splitting.erase(it);
    return out;
  }
};

namespace {

class ThreadMember final : public ProcessGroup {
 public:
  ThreadMember(std::shared_ptr<ThreadGroup::Shared> shared, int me) : shared_(std::move(shared)), me_(me) {}

  int rank() const override { return me_; }
  int size() const override { return shared_->size; }
  bool threads_of_one_process() const override { return true; }
  void barrier() override {
    shared_->exchange(me_, {}, [](std::vector<Bytes>&, std::uint64_t) { return 0; });
  }

  std::unique_ptr<ProcessGroup> split(int color, int key) override {
    Writer w;
    w.i64(color);
    w.i64(key);
    std::uint64_t round = 0;
    const auto all = shared_->exchange(me_, w.take(), [&](std::vector<Bytes>& r, std::uint64_t g) {
      round = g;
      return r;
    });
    // Members of my color, ordered by key and then by rank in this group.
    std::vector<std::pair<std::int64_t, int>> mine;
    for (int r = 0; r < size(); ++r) {
      Reader in(all[static_cast<std::size_t>(r)]);
      const std::int64_t c = in.i64();
      if (c == color) mine.emplace_back(in.i64(), r);
    }
    std::sort(mine.begin(), mine.end());
    const auto me = std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.second == me_; });
    return std::make_unique<ThreadMember>(shared_->child(round, color, static_cast<int>(mine.size())),
                                          static_cast<int>(me - mine.begin()));
  }

  // Each member publishes where its rows are; each then copies the other members' shares out of
  // their memory into its own, and none returns before all have copied.
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override {
    Writer w;
    w.i64(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(rows.data())));
    w.i64(static_cast<std::int64_t>(rows.row_bytes()));
    w.dims(counts);
    const auto all = all_gather(checked(
        [&] {
          require_row_counts(rows, counts, size());
          require(rows.space().host_accessible(), Errc::invalid_argument, "a thread group moves host memory, not ",
                  memory_space_text(rows.space()), " memory");
        },
        w.take()));
    const auto members = payloads_or_throw("gathering rows", all);
    std::int64_t start = 0;
    for (int r = 0; r < size(); ++r) {
      Reader in(members[static_cast<std::size_t>(r)]);
      const auto* from = reinterpret_cast<const std::byte*>(static_cast<std::uintptr_t>(in.i64()));
      const std::int64_t row_bytes = in.i64();
      require(row_bytes == static_cast<std::int64_t>(rows.row_bytes()) && in.dims() == std::vector(counts.begin(), counts.end()),
              Errc::invalid_argument, "gathering rows: member ", r, " gathers rows of ", row_bytes, " bytes, member ",
              me_, " of ", rows.row_bytes(), " bytes, or with other counts");
      const std::int64_t n = counts[static_cast<std::size_t>(r)];
      if (r != me_ && n > 0)
        std::memcpy(rows.slice_rows(start, start + n).data(), from + start * row_bytes, static_cast<std::size_t>(n * row_bytes));
      start += n;
    }
    barrier();
  }

  Bytes broadcast(std::span<const std::byte> bytes, int root) override {
    require_root(root, size());
    return shared_->exchange(me_, me_ == root ? bytes : std::span<const std::byte>(),
                             [&](std::vector<Bytes>& all, std::uint64_t) { return all[static_cast<std::size_t>(root)]; });
  }

 protected:
  std::vector<Bytes> all_gather(std::span<const std::byte> mine) override {
    return shared_->exchange(me_, mine, [](std::vector<Bytes>& all, std::uint64_t) { return all; });
  }
  std::vector<Bytes> gather(std::span<const std::byte> mine, int root) override {
    require_root(root, size());
    // Only the root reads the round's result, so it may take it.
    return shared_->exchange(me_, mine, [&](std::vector<Bytes>& all, std::uint64_t) {
      return me_ == root ? std::move(all) : std::vector<Bytes>();
    });
  }

 private:
  std::shared_ptr<ThreadGroup::Shared> shared_;
  int me_;
};

}  // namespace

ThreadGroup::ThreadGroup(int size) {
  require(size >= 1, Errc::invalid_argument, "a thread group needs at least one rank (got ", size, ")");
  shared_ = std::make_shared<Shared>(size);
  for (int r = 0; r < size; ++r) members_.push_back(std::make_unique<ThreadMember>(shared_, r));
}

ThreadGroup::~ThreadGroup() = default;

int ThreadGroup::size() const noexcept { return shared_->size; }

ProcessGroup& ThreadGroup::member(int rank) {
  require(rank >= 0 && rank < size(), Errc::invalid_argument, "rank ", rank, " is outside a thread group of ", size());
  return *members_[static_cast<std::size_t>(rank)];
}

void ThreadGroup::abort(const std::string& reason) { shared_->abort(reason); }

void run_ranks(int ranks, const std::function<void(ProcessGroup&)>& fn) {
  ThreadGroup group(ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  std::optional<Error> not_started;
  for (int r = 0; r < ranks && !not_started; ++r) {
    try {
      threads.emplace_back([&, r] {
        try {
          fn(group.member(r));
        } catch (const std::bad_alloc&) {
          errors[static_cast<std::size_t>(r)] =
              std::make_exception_ptr(Error(Errc::resources, cat("rank ", r, " ran out of memory")));
          group.abort(cat("rank ", r, " ran out of memory"));
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          group.abort(cat("rank ", r, " failed: ", e.what()));
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          group.abort(cat("rank ", r, " failed"));
        }
      });
    } catch (const std::exception& e) {  // no thread for this rank: the started ones must not wait for it
      not_started.emplace(Errc::collective, cat("could not start the thread of rank ", r, " of ", ranks, ": ", e.what()));
      group.abort(not_started->what());
    }
  }
  for (std::thread& t : threads) t.join();
  if (not_started) throw *not_started;
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

std::string_view save_phase_name(SavePhase phase) noexcept {
  switch (phase) {
    case SavePhase::planning:
      return "planning";
    case SavePhase::writing:
      return "writing";
    case SavePhase::committing:
      return "committing";
    case SavePhase::committed:
      return "committed";
  }
  return "?";
}

namespace {

// What a rank sends rank 0 in planning: its number of checksummed rows, its claims, the parameter records whose
// first element it writes, and (rank 0) the common values.
Bytes planning_payload(const SavePlan& plan, int me) {
  const std::vector<Claim> claims = claims_of(plan, me);
  std::int64_t checksum_rows = 0;
  for (const Claim& c : claims) checksum_rows = checked_add(checksum_rows, claim_checksums(c), "checksum checksum_rows");
  Writer w;
  w.i64(checksum_rows);
  w.i64(static_cast<std::int64_t>(plan.items.size()));
  for (const SaveItem& i : plan.items) put_claim(w, i);
  const std::set<std::string_view> firsts = first_elements(plan);
  std::vector<const ParamRecord*> owned;
  for (const ParamRecord& r : plan.params)
    if (firsts.contains(block_key(r.key, r.blocks.front().name))) owned.push_back(&r);
  w.i64(static_cast<std::int64_t>(owned.size()));
  for (const ParamRecord* r : owned) put_record(w, *r);
  put_common(w, me == 0 ? plan.common : decltype(plan.common){});
  return w.take();
}

// Where a save writes. Rank 0 creates the temporary file (and later commits it); every rank learns
// its directory, its name and its identity, opens it and checks that it opened that very file.
struct Destination {
  std::optional<io::TemporaryFile> temp;  // rank 0
  std::optional<io::File> opened;         // the other ranks
  fs::path dir;
  std::string name;
  io::SharedIdentity identity;
  std::vector<Range> data;  // rank 0: the skeleton's raw data byte ranges, which the seal leaves out

  io::File& file() { return temp ? temp->file() : *opened; }
};

void put_identity(Writer& w, const io::SharedIdentity& id) {
  w.i64(static_cast<std::int64_t>(id.file.device));
  w.i64(static_cast<std::int64_t>(id.file.inode));
  w.i64(static_cast<std::int64_t>(id.machine));
}

io::SharedIdentity get_identity(Reader& r) {
  io::SharedIdentity id;
  id.file.device = static_cast<std::uint64_t>(r.i64());
  id.file.inode = static_cast<std::uint64_t>(r.i64());
  id.machine = static_cast<std::uint64_t>(r.i64());
  return id;
}

// Rank 0's verdict on every rank's plan: validated together, the skeleton created in a fresh
// temporary file beside the destination (a link at `path` is followed: the checkpoint replaces its
// target), and for every rank that file, the datasets' extents and where its checksums start.
Bytes create_checkpoint(const std::vector<std::span<const std::byte>>& payloads, const fs::path& path,
                        const SaveOptions& options, Destination& dest) {
  CheckpointContents contents;
  contents.id = io::random_id();
  contents.checksummed = options.checksums;
  Planned planned = validate_in_parts(payloads, contents);
  if (!options.checksums) planned.checksum_rows = 0;
  io::Destination where = io::Destination::of(path);
  dest.dir = where.path.parent_path();
  dest.temp.emplace(io::TemporaryFile::create(std::move(where)));
  const Skeleton skeleton = create_skeleton(dest.temp->file(), planned.specs, contents, planned.checksum_rows);
  dest.data = skeleton.data;
  Writer w;
  w.str(dest.dir.string());
  w.str(dest.temp->name());
  put_identity(w, dest.temp->identity());
  w.i64(static_cast<std::int64_t>(skeleton.datasets.size()));
  for (const Dataset& d : skeleton.datasets) put_dataset(w, d);
  w.i64(static_cast<std::int64_t>(skeleton.checksums_address));
  w.dims(options.checksums ? planned.first_checksums : std::vector<std::int64_t>{});
  return w.take();
}

// What every rank learns from the verdict: the datasets it writes, and its checksum slot (none
// without checksums).
struct Created {
  std::vector<Dataset> datasets;
  std::optional<ChecksumSlot> slot;
};

Created read_verdict(const Bytes& verdict, const SavePlan& plan, int me, int ranks, Destination& dest) {
  Reader r(verdict);
  dest.dir = r.str();
  dest.name = r.str();
  dest.identity = get_identity(r);
  // Only the datasets this rank writes: what a rank holds grows with its own pieces, not the model.
  std::set<std::string_view> mine;
  for (const SaveItem& i : plan.items)
    if (i.writes) mine.insert(i.key);
  Created out;
  for (std::int64_t n = r.i64(); n > 0; --n) {
    Dataset d = get_dataset(r);
    if (mine.contains(d.key)) out.datasets.push_back(std::move(d));
  }
  const auto checksums_address = static_cast<std::uint64_t>(r.i64());
  const std::vector<std::int64_t> first_checksums = r.dims();
  require(first_checksums.empty() || first_checksums.size() == static_cast<std::size_t>(ranks), Errc::collective,
          "the planning verdict does not have one checksum start per rank");
  if (!first_checksums.empty()) out.slot = ChecksumSlot{checksums_address, first_checksums[static_cast<std::size_t>(me)]};
  return out;
}

// Every rank writes its own pieces and their checksums: all at once on the direct path; on the
// hyperslab path one rank at a time, since HDF5 must not have one file open for writing in two
// processes. Each rank first opens the temporary file rank 0 created and checks that it is that file.
void write_pieces(ProcessGroup& group, const SavePlan& plan, const Created& created, Destination& dest,
                  const SaveOptions& options) {
  agree(group, "opening the temporary file", [&] {
    if (!dest.temp) dest.opened.emplace(io::TemporaryFile::open_created(dest.dir, dest.name, dest.identity));
  });
  const auto write_mine = [&] {
    PieceWriter writer(dest.file(), options.method, created.slot, options.progress);
    write_items(plan, created.datasets, writer, options.staging);
    writer.finish();
  };
  if (options.method == IoMethod::raw) return agree(group, "writing pieces", write_mine);
  for (int turn = 0; turn < group.size(); ++turn)
    agree(group, "writing pieces", [&] {
      if (turn == group.rank()) write_mine();
    });
}

// A save of the plan that `make_plan` returns on each rank (called once, in the planning phase, so
// that its errors are the save's collective errors).
void save_with(const std::function<SavePlan()>& make_plan, const fs::path& path, ProcessGroup& group,
               const SaveOptions& options) {
  const ForbidMaterialization no_copies;
  const int me = group.rank();
  const auto phase = [&](SavePhase p) {
    if (me == 0 && options.on_phase) options.on_phase(p);
  };
  Destination dest;
  try {
    SavePlan plan;
    phase(SavePhase::planning);
    // 1. Every rank's claims reach rank 0 only, which validates them all together before anything
    // touches the disk and creates the file with every dataset at its global shape.
    const Created created = read_verdict(decide_at_root(
                                             group, "planning, validating and creating the checkpoint",
                                             [&] {
                                               plan = make_plan();
                                               return planning_payload(plan, me);
                                             },
                                             [&](const std::vector<std::span<const std::byte>>& payloads) {
                                               return create_checkpoint(payloads, path, options, dest);
                                             }),
                                         plan, me, group.size(), dest);
    // 2. Every rank writes and syncs its pieces.
    phase(SavePhase::writing);
    write_pieces(group, plan, created, dest, options);
    // 3. Only when every rank has written and synced its pieces does rank 0 seal and commit.
    phase(SavePhase::committing);
    agree(group, "committing the checkpoint", [&] {
      if (dest.opened) dest.opened->close();
      if (dest.temp) {
        mark_complete(dest.temp->file(), dest.data);
        dest.temp->commit();
      }
    });
    phase(SavePhase::committed);
  } catch (Error& e) {
    // Nothing was committed; the temporary file rank 0 created goes.
    if (dest.temp) dest.temp->discard();
    throw std::move(e.add_context(cat("saving ", path.string())));
  }
}

// Opens the checkpoint at `path` on every rank. Rank 0 checks the whole seal of the file's
// metadata; the others then only that their file has the seal rank 0 checked, so that the whole
// metadata is read once, not once per rank. Ranks that are threads of one process share rank 0's
// reader: one open file, one HDF5 file and its caches, one copy of each slab table, for all of them.
std::shared_ptr<const CheckpointReader> open_agreed(const fs::path& path, ProcessGroup& group) {
  std::shared_ptr<const CheckpointReader> reader;
  const bool share = group.threads_of_one_process();
  const Bytes sealed = decide_at_root(
      group, cat("opening ", path.string()),
      [&] {
        if (group.rank() == 0) reader = std::make_shared<const CheckpointReader>(path);
        return Bytes();
      },
      [&](const std::vector<std::span<const std::byte>>&) {
        Writer w;
        w.i64(static_cast<std::int64_t>(reader->seal().value_or(0)));
        w.i64(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(&reader)));
        return w.take();
      });
  Reader r(sealed);
  const auto seal = static_cast<std::uint64_t>(r.i64());
  const auto* root = reinterpret_cast<const std::shared_ptr<const CheckpointReader>*>(static_cast<std::uintptr_t>(r.i64()));
  agree(group, cat("opening ", path.string()), [&] {
    if (group.rank() == 0) return;
    // Rank 0's `reader` lives until this phase has ended on every rank.
    reader = share ? *root : std::make_shared<const CheckpointReader>(path, OpenOptions{.trusted_seal = seal});
  });
  return reader;
}

// Every rank opened the checkpoint on its own (or was given one reader): they must all have opened
// the same one, in content as well as in name.
void agree_on_checkpoint(const CheckpointReader& reader, ProcessGroup& group) {
  const std::uint64_t mine = reader.fingerprint();
  const std::vector<Bytes> all = Protocol::all_gather(group, std::as_bytes(std::span(&mine, 1)));
  for (std::size_t r = 0; r < all.size(); ++r) {
    std::uint64_t theirs = 0;
    if (all[r].size() == sizeof theirs) std::memcpy(&theirs, all[r].data(), sizeof theirs);
    require(theirs == mine, Errc::replaced, "loading ", reader.path().string(), ": rank ", group.rank(),
            " opened checkpoint ", reader.contents().id, " but rank ", r,
            " opened another one (the path was replaced while the ranks opened it, or another tool changed a copy)");
  }
}

// Whether the data-parallel copies of this rank's shards can share their reads: the group must be
// able to move every destination's memory, on every copy.
bool can_share(ProcessGroup& replicas, const std::vector<ReplicaRows>& rows) {
  const bool mine = std::all_of(rows.begin(), rows.end(), [&](const ReplicaRows& r) { return replicas.moves(r.rows.space()); });
  const std::byte flag{static_cast<unsigned char>(mine)};
  const auto all = Protocol::all_gather(replicas, std::span(&flag, 1));
  return std::all_of(all.begin(), all.end(), [](const Bytes& b) { return b.size() == 1 && b[0] == std::byte{1}; });
}

// Every shard with copies must be copy replica_id of `replicas.size()`, and replica_id must be
// this rank's place in the group that hands the rows around.
void check_replicas(const StateDict& state, const ProcessGroup& replicas) {
  const auto check = [&](std::string_view key, int id, int count) {
    require(count == 1 || (count == replicas.size() && id == replicas.rank()), Errc::invalid_argument, "key ", key,
            ": replica ", id, " of ", count, " loads through a replica group in which this rank is ", replicas.rank(),
            " of ", replicas.size());
  };
  for (const ShardedTensor& t : state.tensors()) check(t.key, t.replica_id, t.replicas);
  for (const ShardedParam& p : state.params()) check(p.spec.key, p.replica_id, p.replicas);
}

}  // namespace

void save(const StateDict& state, const fs::path& path, ProcessGroup& group, SaveOptions options) {
  save_with([&] { return prepare_save(state); }, path, group, options);
}

void save(const StateDict& state, const fs::path& path, SaveOptions options) {
  SoloGroup solo;
  save(state, path, solo, options);
}

Values load_into(const CheckpointReader& reader, const StateDict& state, ProcessGroup& group, LoadOptions options,
                 ProcessGroup* replicas) {
  agree(group, cat("loading ", reader.path().string()), [&] { agree_on_checkpoint(reader, group); });
  if (group.rank() == 0) notice_unchecked(reader, options);
  const std::vector<ReplicaRows> shared = replica_rows(state);
  options.read_own_share = replicas != nullptr && replicas->size() > 1 && !shared.empty() && can_share(*replicas, shared);
  std::optional<Values> out;
  agree(group, cat("loading ", reader.path().string()), [&] {
    if (options.read_own_share) check_replicas(state, *replicas);
    out.emplace(load_into(reader, state, options));
  });
  // Each copy read its share of every shard's rows: now they hand them to each other.
  if (options.read_own_share)
    for (const ReplicaRows& r : shared) replicas->all_gather_rows(r.rows, r.counts);
  return std::move(*out);
}

Values load_into(const fs::path& path, const StateDict& state, ProcessGroup& group, LoadOptions options,
                 ProcessGroup* replicas) {
  const std::shared_ptr<const CheckpointReader> reader = open_agreed(path, group);
  return load_into(*reader, state, group, std::move(options), replicas);
}

LoadedState load(const CheckpointReader& reader, const StateDict& request, ProcessGroup& group, LoadOptions options,
                 ProcessGroup* replicas) {
  Allocated a = allocate_destinations(request);
  Values values = load_into(reader, a.state, group, std::move(options), replicas);
  return LoadedState(std::move(a.buffers), std::move(values));
}

LoadedState load(const fs::path& path, const StateDict& request, ProcessGroup& group, LoadOptions options,
                 ProcessGroup* replicas) {
  Allocated a = allocate_destinations(request);
  Values values = load_into(path, a.state, group, std::move(options), replicas);
  return LoadedState(std::move(a.buffers), std::move(values));
}

// ---- async saves -------------------------------------------------------------------------------

struct AsyncSave::State {
  std::mutex mutex;
  std::condition_variable changed;
  bool finished = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    const std::lock_guard lock(mutex);
    error = std::move(e);
    finished = true;
    changed.notify_all();
  }
};

AsyncSave::AsyncSave(AsyncSave&&) noexcept = default;
AsyncSave& AsyncSave::operator=(AsyncSave&&) noexcept = default;
AsyncSave::~AsyncSave() = default;

void AsyncSave::wait() {
  require(state_ != nullptr, Errc::invalid_argument, "waiting for no save");
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] { return state_->finished; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool AsyncSave::done() const {
  if (!state_) return false;
  const std::lock_guard lock(state_->mutex);
  return state_->finished;
}

struct Saver::Impl {
  SaverOptions options;
  std::optional<StagingPool> pool;
  std::unique_ptr<ProcessGroup> group;  // private: background saves never meet the caller's collectives
  SharedBuffer staging;                 // where async saves stage this rank's bytes; sized once
  std::thread background;

  SaveOptions save_options() const {
    SaveOptions o = options.save;
    if (pool) o.staging = &*pool;
    return o;
  }

  // The previous save, if one runs, must end before the next begins.
  void join() {
    if (background.joinable()) background.join();
  }

  // Copies every byte this rank writes into the staging memory (allocated by the first call) and
  // returns the plan of those copies.
  SavePlan stage(const StateDict& state) {
    constexpr std::size_t align = 64;
    SavePlan plan = prepare_save(state);
    std::size_t need = 0;
    for (const SaveItem& i : plan.items)
      if (i.writes) need = (need + align - 1) / align * align + i.data.bytes();
    if (!staging)
      staging = options.engine ? options.engine->allocate_pinned(std::max(need, options.async_staging_bytes))
                               : allocate_locked(std::max(need, options.async_staging_bytes));
    require(need <= staging.bytes(), Errc::invalid_argument, "an async save of ", need,
            " bytes does not fit the staging memory of ", staging.bytes(),
            " bytes sized by the first (set SaverOptions::async_staging_bytes, or make a new Saver)");
    std::byte* base = staging.mut_view().data();
    std::size_t at = 0;
    for (SaveItem& i : plan.items) {
      if (!i.writes) {
        i.data = {};  // never read: another rank writes these rows
        continue;
      }
      at = (at + align - 1) / align * align;
      const MutTensorView to = MutTensorView::borrow(base + at, i.data.dtype(), i.data.shape(), MemorySpace::pinned());
      at += i.data.bytes();
      if (i.data.space().host_accessible()) {
        if (!i.data.empty()) std::memcpy(to.data(), i.data.data(), i.data.bytes());
      } else {
        require(options.engine != nullptr && options.engine->device() == i.data.space(), Errc::invalid_argument, "key ",
                i.key, ": an async save of ", memory_space_text(i.data.space()),
                " memory needs a Saver with that device's CopyEngine");
        options.engine->copy_to_host(i.data, to);
      }
      i.data = to;
    }
    if (options.engine) options.engine->wait(options.engine->fence());
    return plan;
  }
};

Saver::Saver(ProcessGroup& group, SaverOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->group = group.split(0, group.rank());
  agree(*impl_->group, "making a saver", [&] {
    if (impl_->options.engine)
      impl_->pool.emplace(*impl_->options.engine, impl_->options.staging_buffer_bytes, impl_->options.staging_buffers);
  });
}

Saver::~Saver() { impl_->join(); }

void Saver::save(const StateDict& state, const fs::path& path) {
  impl_->join();
  shardckpt::save(state, path, *impl_->group, impl_->save_options());
}

AsyncSave Saver::save_async(const StateDict& state, const fs::path& path) {
  impl_->join();
  require(impl_->group->supports_background(), Errc::invalid_argument,
          "this process group cannot run a save in the background (MPI needs MPI_THREAD_MULTIPLE; NCCL's "
          "collectives on another thread can deadlock with the trainer's: give the Saver an MPI or thread group)");
  // A failure to stage is this rank's error in the save's planning phase, so that every rank learns it.
  std::exception_ptr staging_error;
  auto plan = std::make_shared<SavePlan>();
  try {
    *plan = impl_->stage(state);
  } catch (const std::exception&) {
    staging_error = std::current_exception();
  }
  auto outcome = std::make_shared<AsyncSave::State>();
  auto run = [impl = impl_.get(), plan, staging_error, path, outcome] {
    try {
      save_with(
          [&] {
            if (staging_error) std::rethrow_exception(staging_error);
            return std::move(*plan);
          },
          path, *impl->group, impl->save_options());
      outcome->finish(nullptr);
    } catch (...) {
      outcome->finish(std::current_exception());
    }
  };
  try {
    impl_->background = std::thread(run);
  } catch (const std::system_error&) {
    run();  // no thread to spare: the save still happens, in the caller's time
  }
  return AsyncSave(outcome);
}

std::size_t Saver::staging_bytes() const {
  return (impl_->pool ? impl_->pool->bytes() : 0) + impl_->staging.bytes();
}

}  // namespace shardckpt
