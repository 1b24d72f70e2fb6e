/* shardckpt.h: the C API of shardckpt, for code that cannot import C++20 modules (C, C++17, a
 * framework's extension). It describes a rank's GTP-sharded parameters by pointers, shapes and
 * dtypes, and saves and loads them through the C++ library, which does all the work: nothing is
 * gathered, pad rows never reach the file, and a load fills the caller's padded shards in place
 * (docs/c-api.md). Link with `pkg-config --cflags --libs shardckpt-c`; no module flags are needed.
 *
 * Every function that can fail returns an int, SHARDCKPT_OK (0) or a shardckpt_errc; the message of
 * the calling thread's last failure is shardckpt_last_error(). Strings are UTF-8, NUL-terminated, and
 * copied by the call that takes them. The library never keeps a pointer given to it beyond the
 * state that holds it: shard memory stays the caller's. */
#ifndef SHARDCKPT_SHARDCKPT_H
#define SHARDCKPT_SHARDCKPT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SHARDCKPT_C_API_VERSION 1

/* What went wrong: shardckpt::Errc plus one, in its order (docs/user-guide.md, "Errors"). */
typedef enum shardckpt_errc {
  SHARDCKPT_OK = 0,
  SHARDCKPT_ERR_INVALID_ARGUMENT = 1,          /* a bad value from the caller (sizes, names, a null pointer) */
  SHARDCKPT_ERR_LAYOUT = 2,                    /* geometry that cannot be built (sections, TP, GTP, alignment) */
  SHARDCKPT_ERR_TILING = 3,                    /* pieces that overlap or leave a gap */
  SHARDCKPT_ERR_DTYPE_MISMATCH = 4,            /* ranks, file or caller disagree on a dtype or a value's kind */
  SHARDCKPT_ERR_SHAPE_MISMATCH = 5,            /* ranks, file or a shard buffer disagree on a shape */
  SHARDCKPT_ERR_MISSING_KEY = 6,               /* a key asked for is not there */
  SHARDCKPT_ERR_NOT_A_CHECKPOINT = 7,          /* the file is not a complete shardckpt checkpoint */
  SHARDCKPT_ERR_CORRUPT = 8,                   /* bytes read back differ from the bytes saved */
  SHARDCKPT_ERR_REPLACED = 9,                  /* the checkpoint was replaced while it was being loaded */
  SHARDCKPT_ERR_IO = 10,                       /* the operating system refused a read or write */
  SHARDCKPT_ERR_HDF5 = 11,                     /* the HDF5 library reported an error */
  SHARDCKPT_ERR_MATERIALIZATION_FORBIDDEN = 12, /* a full copy was asked for where none may be made */
  SHARDCKPT_ERR_COLLECTIVE = 13,               /* another rank failed */
  SHARDCKPT_ERR_DEVICE = 14,                   /* a device or its runtime failed */
  SHARDCKPT_ERR_RESOURCES = 15,                /* not enough memory, file descriptors or threads */
  SHARDCKPT_ERR_SHARD_CHANGED = 16,            /* a shard changed while an async save still read it */
  SHARDCKPT_ERR_INTERNAL = 17,                 /* anything else */
  SHARDCKPT_ERR_COMMITTED_PEER_FAILED = 18     /* the save committed the checkpoint, then another rank failed */
} shardckpt_errc;

/* Element types, in shardckpt::DType's order. */
typedef enum shardckpt_dtype {
  SHARDCKPT_BF16 = 0,
  SHARDCKPT_F16 = 1,
  SHARDCKPT_F32 = 2,
  SHARDCKPT_F64 = 3,
  SHARDCKPT_I8 = 4,
  SHARDCKPT_I16 = 5,
  SHARDCKPT_I32 = 6,
  SHARDCKPT_I64 = 7,
  SHARDCKPT_U8 = 8,
  SHARDCKPT_U16 = 9,
  SHARDCKPT_U32 = 10,
  SHARDCKPT_U64 = 11
} shardckpt_dtype;

/* How tensor parallelism splits the global weight: along dim 0 block by block (column-parallel and
 * fused weights), along dim 1 (row-parallel weights, one section), or not at all. */
typedef enum shardckpt_tp_axis { SHARDCKPT_TP_ROWS = 0, SHARDCKPT_TP_COLS = 1, SHARDCKPT_TP_REPLICATED = 2 } shardckpt_tp_axis;

/* A named run of TP-local rows of a fused weight, saved as the key "<param key>.<name>"; one section
 * with an empty name is a plain weight, saved under the parameter key. */
typedef struct shardckpt_section {
  const char* name;
  int64_t rows;
} shardckpt_section;

/* A global model size TP must divide (a fused layout's heads and groups): recorded in the checkpoint,
 * so that a load at a TP that does not divide it is refused ("<key>: heads (8) does not divide by TP 3"). */
typedef struct shardckpt_divisor {
  const char* name;
  int64_t count;
} shardckpt_divisor;

/* One GTP-sharded parameter as one rank holds it: its R TP-local rows over a GTP group of G ranks
 * with alignment A are padded to a multiple of A*G, and GTP rank g holds rows [g*L, (g+1)*L) of
 * them, L = padded rows / G. `shard` is the rank's padded shard, row-major, of shape (padded rows,
 * trailing...) (shardckpt_shard_rows): real rows first, zero pad rows at the tail; `shard_bytes` is
 * the size of that buffer, checked against the layout. */
typedef struct shardckpt_param {
  const char* key;
  const shardckpt_section* sections; /* TP-local row counts in row order */
  size_t section_count;
  const int64_t* trailing; /* TP-local trailing dims, contiguous within a row */
  size_t trailing_count;
  shardckpt_tp_axis tp_axis;
  int64_t tp, tp_rank;   /* TP degree and this rank's TP rank */
  int64_t gtp, gtp_rank; /* GTP group size and this rank's GTP rank */
  int64_t align;         /* alignment in rows (0: none; the rows must then divide by gtp) */
  shardckpt_dtype dtype;
  void* shard;
  size_t shard_bytes;
  const shardckpt_divisor* divisors; /* may be NULL with divisor_count 0 (a plain weight) */
  size_t divisor_count;
} shardckpt_param;

/* One rank's state dict: parameters (borrowing their shard memory) and common values. */
typedef struct shardckpt_state shardckpt_state;
/* The common values a load returned. */
typedef struct shardckpt_values shardckpt_values;

typedef enum shardckpt_value_kind {
  SHARDCKPT_VALUE_INT = 0,
  SHARDCKPT_VALUE_DOUBLE = 1,
  SHARDCKPT_VALUE_STRING = 2
} shardckpt_value_kind;

/* ---- errors and versions ------------------------------------------------------------------- */

/* The message of this thread's last failed call ("" before any failure); valid until this thread's
 * next failing call. It names the key, the rank and the rows, as the C++ library's errors do. */
const char* shardckpt_last_error(void);
/* The code of this thread's last failed call (SHARDCKPT_OK before any failure). */
int shardckpt_last_errc(void);
/* "invalid_argument", "shape_mismatch"...; "ok" for SHARDCKPT_OK, "unknown" for anything else. */
const char* shardckpt_errc_name(int code);
/* The library's version, "0.3.0". */
const char* shardckpt_version(void);

/* ---- geometry ----------------------------------------------------------------------------------- */

/* The rows of `param`'s padded shard on its GTP rank (the same on every rank) and how many of them
 * are real (the rest are pad rows; 0 on a padding-only rank). Either output may be NULL. The shard
 * and shard_bytes fields are not read. */
int shardckpt_shard_rows(const shardckpt_param* param, int64_t* padded_rows, int64_t* real_rows);

/* ---- state dicts -------------------------------------------------------------------------------- */

/* A new, empty state dict; NULL when memory runs out (see shardckpt_last_error). */
shardckpt_state* shardckpt_state_new(void);
/* Frees a state dict (NULL is ignored); the shard memory it borrowed stays the caller's. */
void shardckpt_state_free(shardckpt_state* state);
/* Adds a parameter. Everything is copied except the shard memory, which the state borrows: the
 * caller keeps it alive, and unchanged while a save runs, until it frees the state. A key appears
 * once across parameters and values. */
int shardckpt_state_add_param(shardckpt_state* state, const shardckpt_param* param);
/* Adds a common value: saved once for the whole checkpoint (rank 0's value). */
int shardckpt_state_add_int(shardckpt_state* state, const char* key, int64_t value);
int shardckpt_state_add_double(shardckpt_state* state, const char* key, double value);
int shardckpt_state_add_string(shardckpt_state* state, const char* key, const char* value);

/* ---- save and load --------------------------------------------------------------------------- */

/* Saves one process's state dict as the checkpoint at `path`, atomically: on failure nothing is
 * committed and an earlier file at `path` is untouched. */
int shardckpt_save(const shardckpt_state* state, const char* path);
/* Saves `ranks` state dicts as one checkpoint, one rank per state (states[r] is rank r), run as
 * threads of this process: the ranks of a TP x GTP layout that one process holds. Every state's
 * pieces are validated together before a byte is written. The states are not changed (they are
 * not const only so that C callers pass an array of state pointers as it is). */
int shardckpt_save_ranks(shardckpt_state* const* states, int ranks, const char* path);

/* Loads into the shards of one process's state dict, at the layout its parameters describe (which
 * need not be the saving one): real rows are read straight into place, pad rows are zeroed. A shard
 * whose size differs from its padded shard is refused before anything is read. With `values` not
 * NULL, *values receives the checkpoint's common values (free them with shardckpt_values_free). */
int shardckpt_load_into(const char* path, shardckpt_state* state, shardckpt_values** values);
/* The same for `ranks` state dicts run as threads (states[r] is rank r); *values from rank 0. */
int shardckpt_load_into_ranks(const char* path, shardckpt_state* const* states, int ranks, shardckpt_values** values);

/* ---- reads into new memory ----------------------------------------------------------------------- */

/* Tensors a read returned, in memory the handle owns (freed with it). */
typedef struct shardckpt_tensors shardckpt_tensors;

/* One of them: row-major, `bytes` bytes at `data` (writable; NULL only when bytes is 0), of `rank`
 * dims at `shape` (0 for a scalar). Valid until shardckpt_tensors_free. */
typedef struct shardckpt_tensor {
  shardckpt_dtype dtype;
  const int64_t* shape;
  size_t rank;
  void* data;
  size_t bytes;
} shardckpt_tensor;

/* Reads every tensor of the checkpoint at `path` as TP rank `tp_rank` of `tp` holds it, without
 * padding (tp 1: whole tensors, a fused weight's blocks joined in row order), and its common values
 * into *values when `values` is not NULL. With `map` not 0, a tensor whose rows lie in the file as
 * it holds them (a run of rows of one contiguous dataset, or blocks on whole pages) is a private
 * mapping of the file: its rows are checked against their checksums before the call returns, and a
 * write to it never reaches the file; the rest is read into allocated memory, as with `map` 0. A
 * mapping keeps the file open until the handle is freed; a file a later save replaces stays valid
 * under it, one another program truncates does not (docs/c-api.md). */
int shardckpt_read(const char* path, int64_t tp, int64_t tp_rank, int map, shardckpt_tensors** tensors,
                   shardckpt_values** values);
void shardckpt_tensors_free(shardckpt_tensors* tensors);
size_t shardckpt_tensors_count(const shardckpt_tensors* tensors);
/* The key of tensor `index` (keys in byte order), NULL when `index` is out of range. */
const char* shardckpt_tensors_key(const shardckpt_tensors* tensors, size_t index);
/* SHARDCKPT_ERR_MISSING_KEY for a key that is not there. */
int shardckpt_tensors_get(shardckpt_tensors* tensors, const char* key, shardckpt_tensor* out);

/* ---- what a checkpoint holds --------------------------------------------------------------------- */

/* What the checkpoint at `path` holds, as the JSON text `shardckpt inspect --json` prints
 * (docs/cli.md): its tensors (key, dtype, global shape, bytes), parameter records, common values,
 * format version, checkpoint id and whether it is checksummed. *json receives the text,
 * NUL-terminated, to free with shardckpt_string_free. */
int shardckpt_inspect(const char* path, char** json);
void shardckpt_string_free(char* text);

/* ---- common values ------------------------------------------------------------------------------ */

void shardckpt_values_free(shardckpt_values* values);
size_t shardckpt_values_count(const shardckpt_values* values);
/* The key of value `index` (keys in byte order), NULL when `index` is out of range. */
const char* shardckpt_values_key(const shardckpt_values* values, size_t index);
/* SHARDCKPT_ERR_MISSING_KEY for a key that is not there; SHARDCKPT_ERR_DTYPE_MISMATCH when the
 * value is of another kind. A string stays valid while `values` lives. */
int shardckpt_values_kind(const shardckpt_values* values, const char* key, shardckpt_value_kind* kind);
int shardckpt_values_int(const shardckpt_values* values, const char* key, int64_t* out);
int shardckpt_values_double(const shardckpt_values* values, const char* key, double* out);
int shardckpt_values_string(const shardckpt_values* values, const char* key, const char** out);

#ifdef __cplusplus
}
#endif

#endif /* SHARDCKPT_SHARDCKPT_H */
