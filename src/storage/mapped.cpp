// Registered file mappings and guarded reads of their bytes (modules/storage/file.cppm,
// MappedRange): a file cut short under a mapping of it is an error of the read that met the lost
// page, never the death of the process, wherever the library itself reads the mapped bytes.
//
// How: one SIGBUS handler for the process (installed by the first registration, put back on top by
// a later one where another handler replaced it), a table of registered ranges it reads without
// locks, and a recovery point per thread that run_guarded sets with sigsetjmp (without the signal
// mask: no system call per guarded call; the handler runs with SA_NODEFER, so the mask needs no
// restoring). A fault on a registered page while the thread is in a guarded call jumps back to it;
// any other SIGBUS goes to the handler that was there before, or to the default action.
module;
#include <setjmp.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
module shardckpt.storage;
import shardckpt.core;

namespace shardckpt::io {

namespace {

// At most this many mappings registered at once (a reader's mapping of the file, and each tensor
// joined from runs of it): past that the caller reads into memory instead.
constexpr int max_ranges = 1024;

struct Range {
  std::atomic<std::uintptr_t> begin{0}, end{0};  // begin 0: a free slot
  std::atomic<const char*> name{nullptr};        // the file, for the handler's message
};

Range ranges[max_ranges];
std::string names[max_ranges];   // under `lock`; ranges[i].name points into names[i]
bool taken[max_ranges] = {};     // under `lock`
std::atomic<int> in_use{0};      // slots below this may be taken: the handler looks at those
std::mutex lock;

struct sigaction previous {};  // what handled SIGBUS before this handler (under `lock` when set)

// The recovery point of the guarded call this thread is in (nullptr: none). Volatile: the handler
// reads and writes them behind the compiler's back (a store of `recovery` around a memcpy is
// otherwise dead to it, and the fault seen after the jump would be the 0 it started with).
struct Recovery {
  sigjmp_buf at;
  volatile std::uintptr_t fault = 0;
};
thread_local Recovery* volatile recovery = nullptr;

// The registered slot holding `address`, -1 when none does (lock-free: the handler's lookup).
int slot_of(std::uintptr_t address) noexcept {
  const int n = in_use.load(std::memory_order_acquire);
  for (int i = 0; i < n; ++i) {
    const std::uintptr_t begin = ranges[i].begin.load(std::memory_order_acquire);
    if (begin != 0 && begin <= address && address < ranges[i].end.load(std::memory_order_acquire)) return i;
  }
  return -1;
}

void say(const char* text) noexcept {
  if (text) (void)!::write(STDERR_FILENO, text, std::strlen(text));
}

void on_sigbus(int signal, siginfo_t* info, void* context);

bool ours(const struct sigaction& a) noexcept {
  return (a.sa_flags & SA_SIGINFO) != 0 && a.sa_sigaction == &on_sigbus;
}

// A SIGBUS this library does not recover from: to the handler before it, then the default action
// (the fault happens again on return from here, and ends the process as SIGBUS does).
void pass_on(int signal, siginfo_t* info, void* context) noexcept {
  const struct sigaction before = previous;
  if ((before.sa_flags & SA_SIGINFO) != 0 && before.sa_sigaction != nullptr && !ours(before))
    before.sa_sigaction(signal, info, context);
  else if ((before.sa_flags & SA_SIGINFO) == 0 && before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN)
    before.sa_handler(signal);
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  ::sigaction(SIGBUS, &fallback, nullptr);
}

void on_sigbus(int signal, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {  // a fault, not a signal someone sent
    const auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
    if (const int slot = slot_of(address); slot >= 0) {
      if (Recovery* r = recovery) {
        r->fault = address;
        siglongjmp(r->at, 1);
      }
      say("shardckpt: ");
      say(ranges[slot].name.load(std::memory_order_acquire));
      say(": the file was cut short by another program under a mapping of it that is still in use (a tensor read "
          "from it with map=True): its lost pages cannot be read (SIGBUS)\n");
    }
  }
  pass_on(signal, info, context);
}

// Puts this handler first for SIGBUS, keeping whatever was there as the one to pass faults on to.
// Under `lock`.
void install() noexcept {
  struct sigaction now {};
  if (::sigaction(SIGBUS, nullptr, &now) != 0 || ours(now)) return;
  struct sigaction mine {};
  mine.sa_sigaction = &on_sigbus;
  mine.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&mine.sa_mask);
  previous = now;
  ::sigaction(SIGBUS, &mine, nullptr);
}

}  // namespace

MappedRange::MappedRange(const void* at, std::size_t bytes, const std::filesystem::path& path) noexcept {
  const auto begin = reinterpret_cast<std::uintptr_t>(at);
  if (begin == 0 || bytes == 0) return;
  const std::lock_guard hold(lock);
  install();
  for (int i = 0; i < max_ranges; ++i) {
    if (taken[i]) continue;
    try {
      names[i] = path.string();
    } catch (...) {
      return;
    }
    taken[i] = true;
    ranges[i].name.store(names[i].c_str(), std::memory_order_release);
    ranges[i].end.store(begin + bytes, std::memory_order_release);
    ranges[i].begin.store(begin, std::memory_order_release);
    if (in_use.load(std::memory_order_relaxed) <= i) in_use.store(i + 1, std::memory_order_release);
    slot_ = i;
    return;
  }
}

MappedRange::~MappedRange() {
  if (slot_ < 0) return;
  const std::lock_guard hold(lock);
  ranges[slot_].begin.store(0, std::memory_order_release);
  ranges[slot_].end.store(0, std::memory_order_release);
  ranges[slot_].name.store(nullptr, std::memory_order_release);
  names[slot_].clear();
  taken[slot_] = false;
}

// Not inlined into its callers: the jump lands in this frame, which holds nothing to destroy.
[[gnu::noinline]] std::uintptr_t run_guarded(void (*fn)(void*), void* context) noexcept {
  Recovery here;
  Recovery* const outer = recovery;
  if (sigsetjmp(here.at, 0) == 0) {
    recovery = &here;
    fn(context);
    recovery = outer;
    return 0;
  }
  recovery = outer;
  return here.fault;
}

std::string mapped_file_at(std::uintptr_t address) {
  const std::lock_guard hold(lock);
  const int slot = slot_of(address);
  return slot >= 0 ? names[slot] : std::string("another program's file");
}

bool in_mapping(const void* p, std::size_t n) noexcept {
  if (n == 0) return false;
  const auto begin = reinterpret_cast<std::uintptr_t>(p), end = begin + n;
  const int count = in_use.load(std::memory_order_acquire);
  for (int i = 0; i < count; ++i) {
    const std::uintptr_t b = ranges[i].begin.load(std::memory_order_acquire);
    if (b != 0 && b < end && begin < ranges[i].end.load(std::memory_order_acquire)) return true;
  }
  return false;
}

void copy_guarded(void* dst, const void* src, std::size_t n) {
  struct Copy {
    void* dst;
    const void* src;
    std::size_t n;
  } copy{dst, src, n};
  const std::uintptr_t fault = run_guarded(
      [](void* c) {
        const auto& x = *static_cast<const Copy*>(c);
        std::memcpy(x.dst, x.src, x.n);
      },
      &copy);
  if (fault != 0) {
    throw Error(Errc::replaced, cat(mapped_file_at(fault), ": the file was cut short by another program under a mapping ",
                                    "of it (the pages of a tensor read from it with map): bytes it held are lost"));
  }
}

}  // namespace shardckpt::io
