// shardckpt.dist:protocol (implementation partition): how ranks agree. Every step of a collective
// operation exchanges every rank's outcome: either every rank gets every payload, or every rank throws
// the same error (the code of the lowest failing rank, each failure said once). A rank never returns
// before it knows every rank's outcome.
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
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.dist:protocol;
import shardckpt.core;
import :group;
import :wire;

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

// A step's outcome as sent to other ranks: 1 and the payload, or 0, the error code and the message.
inline Bytes outcome(const std::function<Bytes()>& step) {
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
inline std::span<const std::byte> payload_or_throw(std::span<const std::byte> bytes) {
  Reader r(bytes);
  if (r.u8() == 1) return r.rest();
  const auto code = static_cast<Errc>(r.u8());
  throw Error(code, r.str());
}

// "0-3, 5, 7-9": ranks in ascending order, each run of consecutive ranks as its ends.
inline std::string rank_list(const std::vector<std::size_t>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += cat(i ? ", " : "", ranks[i]);
    if (j > i) out += cat(j == i + 1 ? ", " : "-", ranks[j]);
    i = j + 1;
  }
  return out;
}

inline std::string ranks_text(const std::vector<std::size_t>& ranks) {
  return cat(ranks.size() > 1 ? "ranks " : "rank ", rank_list(ranks));
}

// A message with every run of digits as '#': the messages of ranks that failed alike, each naming
// its own TP and GTP rank or rows ("parameter K (TP rank 1, GTP rank 0): ..."), are one failure.
inline std::string without_numbers(std::string_view text) {
  std::string out;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const bool digit = text[i] >= '0' && text[i] <= '9';
    if (!digit) out += text[i];
    else if (out.empty() || out.back() != '#') out += '#';
  }
  return out;
}

// Every rank's payload, or one error for all: the code of the lowest failing rank and each failure
// said once. Ranks that failed with the same message are named together ("ranks 0-3: <text>"), and
// so are ranks whose messages differ only in their numbers (each its own ranks or rows): the lowest
// rank's text stands for them all, so that a message every rank prints does not repeat every rank's
// text. Messages of more than `max_failures` kinds end with the ranks of the rest.
inline std::vector<std::span<const std::byte>> payloads_or_throw(std::string_view phase, const std::vector<Bytes>& outcomes) {
  constexpr std::size_t max_failures = 8;
  struct Failure {
    std::string alike;                 // the message without its numbers
    std::string text;                  // the lowest rank's message
    std::vector<std::size_t> ranks;    // every rank of this kind, ascending
    std::vector<std::size_t> others;   // those whose message differs from `text` in its numbers
  };
  std::vector<std::span<const std::byte>> payloads;
  std::optional<Errc> code;
  std::vector<Failure> failures;  // in the order of their lowest rank
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    try {
      payloads.push_back(payload_or_throw(outcomes[r]));
    } catch (const Error& e) {
      if (!code) code = e.code();
      std::string alike = without_numbers(e.what());
      const auto same = std::find_if(failures.begin(), failures.end(), [&](const Failure& f) { return f.alike == alike; });
      if (same == failures.end()) {
        failures.push_back({std::move(alike), e.what(), {r}, {}});
        continue;
      }
      same->ranks.push_back(r);
      if (same->text != e.what()) same->others.push_back(r);
    }
  }
  if (!code) return payloads;
  std::string text;
  std::vector<std::size_t> rest;
  for (std::size_t i = 0; i < failures.size(); ++i) {
    const Failure& f = failures[i];
    if (i >= max_failures) {
      rest.insert(rest.end(), f.ranks.begin(), f.ranks.end());
      continue;
    }
    text += cat(i ? "; and on " : " failed on ", ranks_text(f.ranks), ": ", f.text);
    if (!f.others.empty())
      text += cat(" (in rank ", f.ranks.front(), "'s words; ", ranks_text(f.others), " said the same of ",
                  f.others.size() > 1 ? "their" : "its", " own numbers)");
  }
  if (!rest.empty()) {
    std::sort(rest.begin(), rest.end());
    text += cat("; and on ", ranks_text(rest), ", otherwise");
  }
  throw Error(*code, cat(phase, text));
}

// One phase decided by rank 0: every rank runs `step`, rank 0 alone sees all payloads and runs
// `decide` on them, and every rank gets rank 0's verdict: its payload, or the same error. What a
// rank holds stays one payload (rank 0: one per rank) however many ranks there are: an all_gather
// would give every rank every rank's outcome, memory that grows with the square of the ranks (4,096
// thread ranks of one process: gigabytes for each phase).
inline Bytes decide_at_root(ProcessGroup& group, std::string_view phase, const std::function<Bytes()>& step,
                     const std::function<Bytes(const std::vector<std::span<const std::byte>>&)>& decide) {
  std::vector<Bytes> gathered = Protocol::gather(group, outcome(step), 0);
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
  gathered = {};
  const Bytes shared = group.broadcast(verdict, 0);
  const auto payload = payload_or_throw(shared);
  return {payload.begin(), payload.end()};
}

// One phase on all ranks: every rank runs `step`, and either every rank succeeds or every rank
// throws the same error (gathered at rank 0 and told to every rank).
inline void agree(ProcessGroup& group, std::string_view phase, const std::function<void()>& step) {
  (void)decide_at_root(
      group, phase,
      [&] {
        step();
        return Bytes();
      },
      [](const std::vector<std::span<const std::byte>>&) { return Bytes(); });
}

// The outcome of a local check as a message, so that every member can learn every member's verdict.
inline Bytes checked(const std::function<void()>& check, Bytes payload) {
  return outcome([&] {
    check();
    return payload;
  });
}

// The objects the roots of groups of thread ranks have on loan, by ticket, with their types: one for
// the process, so that a ticket taken as another type than it was lent as is refused, not cast.
class LoanRegistry {
 public:
  static LoanRegistry& process() {
    static LoanRegistry r;
    return r;
  }
  std::uint64_t lend(std::type_index type, std::shared_ptr<const void> object) {
    const std::lock_guard lock(mutex_);
    lent_.emplace(++last_, std::pair{type, std::move(object)});
    return last_;
  }
  std::shared_ptr<const void> take(std::type_index type, std::uint64_t ticket) const {
    const std::lock_guard lock(mutex_);
    const auto it = lent_.find(ticket);
    require(it != lent_.end() && it->second.first == type, Errc::internal, "ticket ", ticket,
            " names no object of this type on loan among the thread ranks");
    return it->second.second;
  }
  void end(std::uint64_t ticket) {
    const std::lock_guard lock(mutex_);
    lent_.erase(ticket);
  }

 private:
  mutable std::mutex mutex_;
  std::uint64_t last_ = 0;
  std::map<std::uint64_t, std::pair<std::type_index, std::shared_ptr<const void>>> lent_;
};

// An object the root of a group whose members are threads of one process lends to the others (one
// open checkpoint for all thread ranks): while the Loan lives, any member takes a share of it by its
// ticket, a number that travels as metadata, and by its type. A ticket that names no object on loan,
// or one of another type, is Errc::internal: never an address sent as bytes and read back as a pointer.
template <class T>
class Loan {
 public:
  explicit Loan(std::shared_ptr<const T> object)
      : ticket_(LoanRegistry::process().lend(typeid(T), std::move(object))) {}
  Loan(const Loan&) = delete;
  Loan& operator=(const Loan&) = delete;
  ~Loan() { LoanRegistry::process().end(ticket_); }

  std::uint64_t ticket() const noexcept { return ticket_; }
  static std::shared_ptr<const T> take(std::uint64_t ticket) {
    return std::static_pointer_cast<const T>(LoanRegistry::process().take(typeid(T), ticket));
  }

 private:
  std::uint64_t ticket_;
};

}  // namespace shardckpt
