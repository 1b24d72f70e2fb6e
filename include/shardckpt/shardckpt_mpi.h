/* shardckpt_mpi.h: the C API's saves and loads over an MPI communicator, one rank per process
 * (installed when shardckpt was built with MPI). Every process of `comm` calls the same function
 * with its own state dict and the same path; the library duplicates `comm`, so its messages never
 * mix with the caller's, and never initializes or finalizes MPI. Every rank returns the same code:
 * on any failure on any rank nothing is committed. Compile with the MPI the library was built with
 * (mpicc, or its flags beside `pkg-config shardckpt-c`). */
#ifndef SHARDCKPT_SHARDCKPT_MPI_H
#define SHARDCKPT_SHARDCKPT_MPI_H

#include <mpi.h>
#include <shardckpt/shardckpt.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Saves this process's state dict as its rank's part of one checkpoint (collective over `comm`). */
int shardckpt_save_mpi(const shardckpt_state* state, const char* path, MPI_Comm comm);
/* Loads into this process's state dict at its own layout (collective over `comm`); with `values`
 * not NULL, *values receives the checkpoint's common values. */
int shardckpt_load_into_mpi(const char* path, shardckpt_state* state, MPI_Comm comm, shardckpt_values** values);

#ifdef __cplusplus
}
#endif

#endif /* SHARDCKPT_SHARDCKPT_MPI_H */
