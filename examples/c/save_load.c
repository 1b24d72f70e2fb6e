/* The C API end to end: two GTP ranks (threads of this process) save their padded shards of a fused
 * weight [q | k | v] as one checkpoint; one rank loads the whole weight back at GTP 1 and checks every
 * value; a buffer of the wrong size is refused with a code and a message. docs/c-api.md walks
 * through it. Usage: save_load CHECKPOINT */
#include <shardckpt/shardckpt.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define COLS 8

static const shardckpt_section sections[] = {{"q", 10}, {"k", 5}, {"v", 5}}; /* 20 rows */
static const int64_t trailing[] = {COLS};

/* The weight as GTP rank `gtp_rank` of `gtp` holds it, at alignment `align`, without its shard. */
static shardckpt_param weight(int64_t gtp, int64_t gtp_rank, int64_t align) {
  shardckpt_param p;
  memset(&p, 0, sizeof p);
  p.key = "layers.0.qkv.weight";
  p.sections = sections;
  p.section_count = 3;
  p.trailing = trailing;
  p.trailing_count = 1;
  p.tp_axis = SHARDCKPT_TP_ROWS;
  p.tp = 1;
  p.gtp = gtp;
  p.gtp_rank = gtp_rank;
  p.align = align;
  p.dtype = SHARDCKPT_F32;
  return p;
}

static int fail(const char* what) {
  fprintf(stderr, "%s: %s: %s\n", what, shardckpt_errc_name(shardckpt_last_errc()), shardckpt_last_error());
  return 1;
}

/* Two ranks at GTP 2, alignment 4: 12 rows a shard; rank 1 holds 8 real rows and 4 pad rows. */
static int save(const char* path) {
  float shards[2][12 * COLS];
  shardckpt_state* states[2];
  int64_t rows = 0, real = 0;
  for (int g = 0; g < 2; ++g) {
    shardckpt_param p = weight(2, g, 4);
    if (shardckpt_shard_rows(&p, &rows, &real) != SHARDCKPT_OK) return fail("shard rows");
    memset(shards[g], 0, sizeof shards[g]); /* pad rows stay zero */
    for (int64_t i = 0; i < real * COLS; ++i) shards[g][i] = (float)(g * rows * COLS + i); /* row-major */
    p.shard = shards[g];
    p.shard_bytes = sizeof shards[g];
    states[g] = shardckpt_state_new();
    if (shardckpt_state_add_param(states[g], &p) != SHARDCKPT_OK) return fail("add the shard");
    if (shardckpt_state_add_int(states[g], "step", 100) != SHARDCKPT_OK) return fail("add a value");
  }
  const int rc = shardckpt_save_ranks(states, 2, path);
  for (int g = 0; g < 2; ++g) shardckpt_state_free(states[g]);
  return rc == SHARDCKPT_OK ? 0 : fail("save");
}

/* One rank at GTP 1 (no alignment): the whole weight, 20 rows. */
static int load(const char* path) {
  float whole[20 * COLS], too_small[19 * COLS];
  shardckpt_param p = weight(1, 0, 0);
  shardckpt_state* state = shardckpt_state_new();
  shardckpt_values* values = NULL;
  int64_t step = 0;
  p.shard = too_small;
  p.shard_bytes = sizeof too_small;
  if (shardckpt_state_add_param(state, &p) != SHARDCKPT_ERR_SHAPE_MISMATCH) return fail("a short buffer was taken");
  printf("refused: %s\n", shardckpt_last_error());
  p.shard = whole;
  p.shard_bytes = sizeof whole;
  if (shardckpt_state_add_param(state, &p) != SHARDCKPT_OK) return fail("add the destination");
  if (shardckpt_load_into(path, state, &values) != SHARDCKPT_OK) return fail("load");
  if (shardckpt_values_int(values, "step", &step) != SHARDCKPT_OK) return fail("step");
  for (int64_t i = 0; i < 20 * COLS; ++i)
    if (whole[i] != (float)i) return fprintf(stderr, "element %lld differs\n", (long long)i), 1;
  printf("saved at GTP 2, loaded at GTP 1: %d values equal, step %lld\n", 20 * COLS, (long long)step);
  shardckpt_values_free(values);
  shardckpt_state_free(state);
  return 0;
}

/* The weight read into memory the library owns (a private mapping of the file where its rows lie
 * there as the tensor holds them; here the blocks are joined from three places, so read). */
static int read_back(const char* path) {
  shardckpt_tensors* tensors = NULL;
  shardckpt_tensor w;
  if (shardckpt_read(path, 1, 0, 1, &tensors, NULL) != SHARDCKPT_OK) return fail("read");
  if (shardckpt_tensors_get(tensors, "layers.0.qkv.weight", &w) != SHARDCKPT_OK) return fail("get");
  if (w.dtype != SHARDCKPT_F32 || w.rank != 2 || w.shape[0] != 20 || w.shape[1] != COLS) return fail("its shape");
  for (int64_t i = 0; i < 20 * COLS; ++i)
    if (((const float*)w.data)[i] != (float)i) return fprintf(stderr, "element %lld differs\n", (long long)i), 1;
  printf("read: %s [%lld, %lld], %zu bytes\n", shardckpt_tensors_key(tensors, 0), (long long)w.shape[0],
         (long long)w.shape[1], w.bytes);
  shardckpt_tensors_free(tensors);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s CHECKPOINT\n", argv[0]);
    return 2;
  }
  return save(argv[1]) || load(argv[1]) || read_back(argv[1]) ? EXIT_FAILURE : EXIT_SUCCESS;
}
