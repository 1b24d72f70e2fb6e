#!/usr/bin/python3
"""Trust tests: what shardckpt does with names, files and limits it cannot trust.

Single-user part (default, `--part single`):
  - permissions: a new checkpoint gets 0666 less the umask; a replaced one keeps its mode and group;
  - only regular files are replaced: a FIFO, a socket, a directory, a link to a device or a
    character device at the output path is refused (exit 2) and left as it was; a link to a regular
    file has its target replaced;
  - adopt never replaces its own input (same name, a symbolic link to it, a hard link to it);
  - the plain file an adopted checkpoint points at is opened safely: a symbolic link (absolute or
    relative), a FIFO or a link to /dev/zero in its place is refused without hanging, and so is a
    version 1 file whose external storage is an absolute path or a symbolic link;
  - HDF5_EXTFILE_PREFIX (absolute or ${ORIGIN}-relative) naming a directory with another file of the
    plain file's name: load, verify, reshard and inspect still read the file beside the checkpoint;
  - adopt takes every dataset of an h5py file or refuses it: external and soft links, groups, named
    datatypes and external storage are refused by name, never dropped from the checkpoint;
  - a FIFO where a regular file is expected is never opened: a writer blocked on it stays blocked after
    every command that meets it (load, verify, reshard, inspect, adopt; inputs, external files, outputs);
  - paths deeper than PATH_MAX (relative to a deep working directory) work;
  - reshard of a path renamed over, again and again, by two checkpoints that share one checkpoint
    id never writes a mix of the two (the common values of one, tensor bytes of the other);
  - virtual datasets are refused;
  - two saves to one path at once both succeed and leave one complete checkpoint;
  - closed standard streams never let a message land in the checkpoint;
  - load --verify of i8, u8, f16, bf16 and f32 tensors with pad rows;
  - the temporary file of a save (.NAME.<32 hex>.partial) is never read as a checkpoint;
  - resource limits (open files, address space, a load that cannot fit in memory) end in one error
    line, never in a crash;
  - a safetensors file of 100,000 tensors is adopted and verified in bounded time (not quadratic).

Two-user part (`--part shared`, needs root, the user nobody and setpriv; else exit 77): in a
world-writable sticky directory `nobody` plants the old predictable temporary name ckpt.h5.partial
as a symbolic link to a file of root's, a dangling symbolic link into a root-only directory, a 0666
file of its own, and (made by root for it) a hard link to root's file; saves by root (demo, both
write methods, reshard, adopt) must neither write through nor touch what was planted.

The checks live in tests/trust/: support.py (the command line, helpers, the shared inputs),
shared.py (the two-user part), outputs.py, inputs.py, special.py and limits.py (the single-user part).

Usage: trust_test.py path/to/shardckpt [--part single|shared]
Prints "trust: N passed, N failed" and exits non-zero on any failure (77: the part cannot run here).
"""
import shutil

from tally import check, finish
# First: parses the command line, checks the shared part can run (else exits 77), makes the inputs.
from trust.support import args, attacker, work
from trust.inputs import (external_storage, reshard_never_mixes, small_types_with_pad_rows, stale_temporary_files,
                          virtual_datasets)
from trust.special import adopt_drops_nothing, checkpoint_links_refused, extfile_prefix_ignored, fifos_never_opened
from trust.limits import deep_paths, many_tensors, resources
from trust.outputs import (adopt_never_replaces_its_input, closed_streams, concurrent_saves, only_regular_files,
                           permissions)
from trust.shared import shared_part


try:
    if args.part == "shared":
        shared_part(*attacker)
    else:
        for section in (permissions, only_regular_files, adopt_never_replaces_its_input, external_storage,
                        extfile_prefix_ignored, fifos_never_opened, adopt_drops_nothing, checkpoint_links_refused, deep_paths,
                        reshard_never_mixes, virtual_datasets, concurrent_saves, closed_streams,
                        small_types_with_pad_rows, stale_temporary_files, resources, many_tensors):
            try:
                section()
            except Exception as e:  # a section that breaks is a failure, not the end of the others
                check(False, f"{section.__name__} raised {type(e).__name__}: {e}")
finally:
    shutil.rmtree(work, ignore_errors=True)
finish("trust")

