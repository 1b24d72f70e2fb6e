// The C API's errors and versions: this thread's last failure, and the one mapping from the C++
// library's Errc to the C header's codes.
#include <cstddef>
#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <utility>
#include "handles.hpp"

namespace shardckpt::capi {
namespace {

thread_local std::string last_message;
thread_local int last_code = SHARDCKPT_OK;

// The header's codes are Errc + 1, in Errc's order: checked at both ends and at a few points between.
static_assert(SHARDCKPT_ERR_INVALID_ARGUMENT == static_cast<int>(Errc::invalid_argument) + 1);
static_assert(SHARDCKPT_ERR_SHAPE_MISMATCH == static_cast<int>(Errc::shape_mismatch) + 1);
static_assert(SHARDCKPT_ERR_MISSING_KEY == static_cast<int>(Errc::missing_key) + 1);
static_assert(SHARDCKPT_ERR_MATERIALIZATION_FORBIDDEN == static_cast<int>(Errc::materialization_forbidden) + 1);
static_assert(SHARDCKPT_ERR_RESOURCES == static_cast<int>(Errc::resources) + 1);
static_assert(SHARDCKPT_ERR_SHARD_CHANGED == static_cast<int>(Errc::shard_changed) + 1);
static_assert(SHARDCKPT_ERR_INTERNAL == static_cast<int>(Errc::internal) + 1);
static_assert(SHARDCKPT_ERR_COMMITTED_PEER_FAILED == static_cast<int>(Errc::committed_peer_failed) + 1);
constexpr int last_errc = SHARDCKPT_ERR_COMMITTED_PEER_FAILED;

}  // namespace

int fail(int code, std::string message) {
  try {
    last_message = std::move(message);
  } catch (const std::bad_alloc&) {
    last_message.clear();  // the code still says what happened
  }
  last_code = code;
  return code;
}

int code_of(Errc code) noexcept { return static_cast<int>(code) + 1; }

int translate_current_exception() noexcept {
  try {
    throw;
  } catch (const Error& e) {
    return fail(code_of(e.code()), std::string(e.message()));
  } catch (const std::bad_alloc&) {
    return fail(SHARDCKPT_ERR_RESOURCES, "out of memory");
  } catch (const std::system_error& e) {
    const bool resources = e.code() == std::errc::resource_unavailable_try_again;  // a thread not started
    return fail(resources ? SHARDCKPT_ERR_RESOURCES : SHARDCKPT_ERR_INTERNAL, e.what());
  } catch (const std::exception& e) {
    return fail(SHARDCKPT_ERR_INTERNAL, e.what());
  } catch (...) {
    return fail(SHARDCKPT_ERR_INTERNAL, "an unknown exception");
  }
}

int null_argument(const char* function, const char* what) {
  return fail(SHARDCKPT_ERR_INVALID_ARGUMENT, std::string(function) + ": " + what + " is NULL");
}

std::string path_of(const char* path) {
  require(path != nullptr && *path != '\0', Errc::invalid_argument, "the checkpoint path is NULL or empty");
  return path;
}

}  // namespace shardckpt::capi

extern "C" {

const char* shardckpt_last_error(void) { return shardckpt::capi::last_message.c_str(); }

int shardckpt_last_errc(void) { return shardckpt::capi::last_code; }

const char* shardckpt_errc_name(int code) {
  if (code == SHARDCKPT_OK) return "ok";
  if (code < SHARDCKPT_OK || code > shardckpt::capi::last_errc) return "unknown";
  // errc_name returns views of string literals: NUL-terminated.
  return shardckpt::errc_name(static_cast<shardckpt::Errc>(code - 1)).data();
}

const char* shardckpt_version(void) { return shardckpt::library_version().data(); }

}  // extern "C"
