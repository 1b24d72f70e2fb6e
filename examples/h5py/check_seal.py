#!/usr/bin/python3
"""Checks the seal of a checkpoint by hand (docs/format.md, "The seal"): the trailer's tail, the
digest of its range list and page table, and the hash of every 4 KiB page's metadata bytes.
Usage: check_seal.py CHECKPOINT. Exits 1 when the seal does not match the file."""
import struct
import sys

import xxhash

raw = open(sys.argv[1], "rb").read()
regions, pages, sealed_size, digest, trailer_bytes, magic = struct.unpack("<6Q", raw[-48:])
if magic != 0x324C45534B434853:                       # b"SHCKSEL2" as a little-endian u64
    sys.exit("no seal (or the seal of shardckpt 0.2)")
if trailer_bytes != 16 * (regions + pages) + 48 or sealed_size != len(raw) - trailer_bytes:
    sys.exit("the trailer does not describe the file")
tables = raw[sealed_size:sealed_size + 16 * (regions + pages)]
if xxhash.xxh3_64_intdigest(tables) != digest:
    sys.exit("the range list and page table do not match their digest")
ranges = [struct.unpack_from("<2Q", tables, 16 * i) for i in range(regions)]
table = dict(struct.unpack_from("<2Q", tables, 16 * (regions + i)) for i in range(pages))
hashes = {}                                            # page -> the hash of its metadata bytes, in file order
for offset, length in ranges:
    at = offset
    while at < offset + length:
        page = at // 4096
        end = min(offset + length, (page + 1) * 4096)
        hashes.setdefault(page, xxhash.xxh3_64()).update(raw[at:end])
        at = end
bad = [p for p in hashes if table.get(p) != hashes[p].intdigest()]
if bad or len(table) != len(hashes):
    sys.exit(f"the metadata of page {bad[0] if bad else '?'} differs from what was sealed")
print(f"{regions} metadata ranges in {pages} pages, {sealed_size} bytes sealed, digest {digest:#018x}")
