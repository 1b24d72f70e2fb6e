// The C API's handles and its one translation of errors, shared by the units of src/capi/ (never
// installed). The facade holds no save or load logic: each call turns C values into the C++ API's,
// calls it, and turns its outcome into a code and this thread's last-error message. Each unit
// includes this header after its own includes: it imports shardckpt, and imports come last.
#pragma once
#include <shardckpt/shardckpt.h>

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>
import shardckpt;

// One rank's state dict; its parameters borrow the caller's shard memory.
struct shardckpt_state {
  shardckpt::StateDict dict;
};

// Common values a load returned, and their keys in order for access by index.
struct shardckpt_values {
  shardckpt::Values values;
  std::vector<std::string> keys;
};

// Tensors a read returned (the loaded state owns their memory, mapped or allocated), their keys in
// order for access by index and their shapes as the header's int64_t arrays.
struct shardckpt_tensors {
  shardckpt::LoadedState loaded;
  std::vector<std::string> keys;
  std::map<std::string, std::vector<std::int64_t>, std::less<>> shapes;
};

namespace shardckpt::capi {

// Records a failure as this thread's last error and returns its code.
int fail(int code, std::string message);
// The failure for a null argument `what` of `function`.
int null_argument(const char* function, const char* what);
// The header's code of an Errc.
int code_of(Errc code) noexcept;
// Inside a catch: records what was thrown and returns its code (Error by its Errc, std::bad_alloc
// as resources, anything else internal).
int translate_current_exception() noexcept;

// Runs fn (which returns nothing or throws) and returns SHARDCKPT_OK, or the code of what it threw,
// its message recorded: no exception crosses into C.
template <class Fn>
int guarded(Fn&& fn) noexcept {
  try {
    fn();
    return SHARDCKPT_OK;
  } catch (...) {
    return translate_current_exception();
  }
}

// A new values handle holding `values` (throws std::bad_alloc).
shardckpt_values* values_of(Values values);

// A path given by the caller; throws Errc::invalid_argument for a null or empty one.
std::string path_of(const char* path);

}  // namespace shardckpt::capi
