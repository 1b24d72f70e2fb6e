/* The C API over MPI (shardckpt_mpi.h), as C: every process is one GTP rank. Two ranks save their
 * padded shards at alignment 4, load them back at alignment 0 (another shard size) and check every
 * row, pad rows included; a rank with a NULL state makes every rank fail with a code, none waits.
 * Run with mpirun -np 2. Usage: capi_mpi_test DIRECTORY */
#include <shardckpt/shardckpt_mpi.h>

#include <stdio.h>
#include <string.h>

#define COLS 3
#define ROWS 18 /* GTP 2: 12 rows a shard at alignment 4 (6 pad rows), 9 at alignment 0 */

static const shardckpt_section sections[] = {{"gate", 10}, {"up", 8}};
static const int64_t trailing[] = {COLS};

static int failures = 0;
#define CHECK(cond, ...) \
  do {                   \
    if (!(cond)) {       \
      ++failures;        \
      fprintf(stderr, "rank %d: line %d: ", rank, __LINE__), fprintf(stderr, __VA_ARGS__), fputc('\n', stderr); \
    }                    \
  } while (0)

static shardckpt_state* state_with(int rank, int64_t align, double* shard, size_t bytes) {
  shardckpt_param p;
  memset(&p, 0, sizeof p);
  p.key = "mlp.fc1.weight";
  p.sections = sections;
  p.section_count = 2;
  p.trailing = trailing;
  p.trailing_count = 1;
  p.tp = 1;
  p.gtp = 2;
  p.gtp_rank = rank;
  p.align = align;
  p.dtype = SHARDCKPT_F64;
  p.shard = shard;
  p.shard_bytes = bytes;
  shardckpt_state* state = shardckpt_state_new();
  if (shardckpt_state_add_param(state, &p) != SHARDCKPT_OK) fprintf(stderr, "add: %s\n", shardckpt_last_error());
  return state;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char path[4096];
  snprintf(path, sizeof path, "%s/capi_mpi.h5", argc > 1 ? argv[1] : ".");

  double saved[12 * COLS] = {0}, loaded[9 * COLS];
  for (int i = 0; i < 12 * COLS; ++i)
    if (rank * 12 + i / COLS < ROWS) saved[i] = rank * 12 * COLS + i; /* pad rows stay zero */
  shardckpt_state* out = state_with(rank, 4, saved, sizeof saved);
  shardckpt_state_add_string(out, "run", "mpi");
  CHECK(shardckpt_save_mpi(out, path, MPI_COMM_WORLD) == SHARDCKPT_OK, "save: %s", shardckpt_last_error());

  memset(loaded, 0xff, sizeof loaded);
  shardckpt_state* in = state_with(rank, 0, loaded, sizeof loaded);
  shardckpt_values* values = NULL;
  const char* run = NULL;
  CHECK(shardckpt_load_into_mpi(path, in, MPI_COMM_WORLD, &values) == SHARDCKPT_OK, "load: %s", shardckpt_last_error());
  for (int i = 0; i < 9 * COLS; ++i) CHECK(loaded[i] == rank * 9 * COLS + i, "element %d is %g", i, loaded[i]);
  CHECK(shardckpt_values_string(values, "run", &run) == SHARDCKPT_OK && strcmp(run, "mpi") == 0, "run");
  shardckpt_values_free(values);

  /* Rank 1 gives no state: both ranks fail, with what was wrong named where it was. */
  const int rc = shardckpt_save_mpi(rank == 1 ? NULL : out, path, MPI_COMM_WORLD);
  CHECK(rc == SHARDCKPT_ERR_INVALID_ARGUMENT, "a NULL state on rank 1 gave %s", shardckpt_errc_name(rc));
  CHECK(strstr(shardckpt_last_error(), rank == 1 ? "state is NULL" : "another rank's argument") != NULL, "%s",
        shardckpt_last_error());

  shardckpt_state_free(out);
  shardckpt_state_free(in);
  int all = 0;
  MPI_Allreduce(&failures, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0) printf("capi_mpi: %s\n", all ? "FAILED" : "every check passed on both ranks");
  MPI_Finalize();
  return all ? 1 : 0;
}
