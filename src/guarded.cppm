// shardckpt.guarded (internal, never installed): state that threads share (the readers of one
// checkpoint, say), held by types instead of by a comment beside a mutex. `Guarded<T>` is reachable
// only through a lock; `Lazy<T>` is made once by whichever thread asks first and read by every
// thread after without a lock (what a reader looks up once and then keeps: a dataset's regions in
// the file, its slab table, the mapping of the file).
module;
#include <atomic>
#include <mutex>
#include <optional>
#include <utility>
export module shardckpt.guarded;

export namespace shardckpt {

// A value behind its mutex: `lock()` gives the only way to it, and holds the mutex as long as the
// handle lives. Logically part of its owner's state even where the owner is const (a monitor).
template <class T>
class Guarded {
 public:
  class Locked {
   public:
    // Not past the handle: a reference kept after it is a reference kept past the lock.
    T& operator*() const noexcept [[clang::lifetimebound]] { return value_; }
    T* operator->() const noexcept [[clang::lifetimebound]] { return &value_; }

   private:
    friend Guarded;
    Locked(std::mutex& m, T& v) : hold_(m), value_(v) {}
    std::unique_lock<std::mutex> hold_;
    T& value_;
  };

  Guarded() = default;
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;

  [[nodiscard]] Locked lock() const { return Locked(mutex_, value_); }

 private:
  mutable std::mutex mutex_;
  mutable T value_{};
};

// A value made at most once and never changed after: the first `get` makes it (a maker that throws
// leaves it unmade, for the next caller to try again), and every `get` after returns it without
// taking a lock. References to it stay valid as long as the Lazy.
template <class T>
class Lazy {
 public:
  Lazy() = default;
  Lazy(const Lazy&) = delete;
  Lazy& operator=(const Lazy&) = delete;

  template <class Make>
  const T& get(Make&& make) const {
    if (made_.load(std::memory_order_acquire)) return *value_;
    const std::lock_guard hold(mutex_);
    if (!value_) {
      value_.emplace(std::forward<Make>(make)());
      made_.store(true, std::memory_order_release);
    }
    return *value_;
  }
  // Whether it was made (by the time of the call).
  bool made() const noexcept { return made_.load(std::memory_order_acquire); }

 private:
  mutable std::mutex mutex_;
  mutable std::atomic<bool> made_{false};
  mutable std::optional<T> value_;
};

}  // namespace shardckpt
