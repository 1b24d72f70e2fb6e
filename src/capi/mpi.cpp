// The C API over MPI: an MpiGroup of the caller's communicator for one save or load (built when
// shardckpt is built with MPI). The collective work and its outcome are the C++ library's.
#include <mpi.h>
#include <shardckpt/shardckpt_mpi.h>

#include <map>
#include <string>
#include <utility>
#include <variant>
#include "handles.hpp"
import shardckpt.dist.mpi;

namespace shardckpt::capi {
namespace {

// A rank whose argument is unusable must not return before the others, which would wait for it in
// the library's collectives: the ranks agree first on whether every rank's arguments are usable.
// `bad` names this rank's unusable argument, or is null.
int agree_on_arguments(const char* function, const char* bad, MPI_Comm comm) {
  const int mine = bad != nullptr;
  int any = 0;
  if (MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS)
    return fail(SHARDCKPT_ERR_COLLECTIVE, std::string(function) + ": MPI_Allreduce failed");
  if (mine) return fail(SHARDCKPT_ERR_INVALID_ARGUMENT, std::string(function) + ": " + bad + " is NULL or empty");
  if (any) return fail(SHARDCKPT_ERR_INVALID_ARGUMENT, std::string(function) + ": another rank's argument is NULL or empty");
  return SHARDCKPT_OK;
}

const char* unusable(const void* state, const char* path) {
  if (state == nullptr) return "state";
  return path == nullptr || *path == '\0' ? "path" : nullptr;
}

}  // namespace
}  // namespace shardckpt::capi

using namespace shardckpt::capi;
namespace sc = shardckpt;

extern "C" {

int shardckpt_save_mpi(const shardckpt_state* state, const char* path, MPI_Comm comm) {
  if (const int rc = agree_on_arguments("shardckpt_save_mpi", unusable(state, path), comm)) return rc;
  return guarded([&] {
    sc::MpiGroup group(comm);
    sc::save(state->dict, path, group);
  });
}

int shardckpt_load_into_mpi(const char* path, shardckpt_state* state, MPI_Comm comm, shardckpt_values** values) {
  if (values) *values = nullptr;
  if (const int rc = agree_on_arguments("shardckpt_load_into_mpi", unusable(state, path), comm)) return rc;
  return guarded([&] {
    sc::MpiGroup group(comm);
    sc::Values loaded = sc::load_into(path, state->dict, group);
    if (values) *values = values_of(std::move(loaded));
  });
}

}  // extern "C"
