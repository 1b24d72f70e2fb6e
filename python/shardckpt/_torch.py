"""TorchGroup: shardckpt's process group over a torch.distributed group.

Every collective the library needs goes through the group's own torch.distributed calls: metadata
as uint8 tensors (torch 1.13's gloo refuses bf16, so rows move as bytes too), gathered to the group's
first rank and broadcast from it; and tensor rows in place: each member broadcasts its share of the
rows straight into the other members' memory.
"""
import collections
import ctypes
import json

# Every tensor this module hands to torch.distributed, the last _LENT of them. A gloo worker thread
# drops its reference to a collective's tensors after the caller's wait() has returned; if that is the
# last reference and the interpreter is finalizing by then (a script that ends without
# destroy_process_group, as torchrun's scripts do), freeing the tensor's Python object takes the GIL on
# that thread, which ends it by pthread_exit inside C++ frames: the process aborts ("terminate called
# without an active exception") after its work. Held here, the last reference is Python's, dropped on
# the thread that holds the GIL, long after gloo let go; and the ring itself is never freed, so the
# tensors of the last collectives are not freed by the finalization either.
_LENT = 64
_lent = collections.deque(maxlen=_LENT)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_lent))


def _lend(*tensors):
    """`tensors`, kept referenced here after the collective that takes them (see _lent)."""
    _lent.extend(tensors)
    return tensors[0]


def _timeout_of(dist, pg):
    """The timeout of torch.distributed group `pg` (the default group when None), where torch says it
    (the options of a ProcessGroupGloo or ProcessGroupNCCL), else None."""
    group = pg if pg is not None else dist.distributed_c10d._get_default_group()
    return getattr(getattr(group, "options", None), "_timeout", None)


class TorchGroup:
    """shardckpt's process group over the torch.distributed group `pg` (the default group when
    None): gloo moves host memory, NCCL device memory. `private` is a second group of the same
    processes for a Saver's background saves when `pg` is not the default group (torch makes a new
    group only with every process of the job, so a subgroup cannot be split)."""

    def __init__(self, pg=None, private=None, _members=None):
        import torch
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchGroup: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group, or start the job with torchrun)")
        self._torch, self._dist, self._pg, self._private = torch, dist, pg, private
        self._world = dist.get_world_size()
        ranks = list(range(self._world)) if pg is None else list(dist.get_process_group_ranks(pg))
        self._sorted = sorted(ranks)
        self._members = list(_members) if _members is not None else self._sorted
        self._rank = self._members.index(dist.get_rank())
        self.INLINE = max(256, min(TorchGroup.INLINE, 32768 // len(self._members)))
        # Collective results come in the group's own rank order (ascending global rank).
        self._group_rank = [self._sorted.index(g) for g in self._members]
        self._nccl = dist.get_backend(pg) == "nccl"
        # The groups split makes (a Saver's private group) time out as this one does: torch's
        # new_group takes its own timeout (30 minutes) otherwise, whatever init_process_group was given.
        self._timeout = _timeout_of(dist, pg)
        self._device = torch.device("cuda", torch.cuda.current_device()) if self._nccl else torch.device("cpu")

    # The group protocol shardckpt's C++ library calls (with the GIL), and what a user may ask.
    def rank(self):
        return self._rank

    def size(self):
        return len(self._members)

    def device_index(self):
        """The CUDA device whose memory the group moves (NCCL), or -1: host memory (gloo)."""
        return self._device.index if self._nccl else -1

    def supports_background(self):
        """gloo runs a Saver's background collectives beside the caller's; NCCL may not (as the C++
        NcclGroup says): over NCCL, Saver.save_async is refused and Saver.save saves in the caller's
        thread."""
        return not self._nccl

    def barrier(self):
        self._dist.barrier(group=self._pg)

    def _uint8(self, data):
        t = self._torch
        if not data:
            return t.zeros(0, dtype=t.uint8, device=self._device)
        return t.frombuffer(bytearray(data), dtype=t.uint8).to(self._device)

    # Metadata moves in slots of INLINE bytes: an 8-byte length, then the payload where it fits. The
    # library's votes and outcomes (1 to 20 bytes) then take one round, and so do a small model's
    # save plans and planning verdict (2 to 5 KB for 24 tensors); a longer payload a second one, at
    # the longest length. A slot is 8 KiB in groups of up to 4 members, smaller in larger groups so
    # that an all_gather's slots stay within 32 KiB (256 bytes from 128 members on): on 4 gloo
    # processes on 2 cores an all_gather and a broadcast of 1 byte took 1.6-1.8 ms with slots of
    # 8 KiB and 1.7-1.9 ms with 256 bytes; of 2,500 bytes 1.6-1.9 ms against 3.1-3.3 ms (two rounds).
    # Gathering to the group's first rank and broadcasting from it is two steps, where an all_gather
    # over gloo is a ring of size - 1 (13 ms against 3 ms for 8 processes on 2 cores,
    # docs/performance.md).
    INLINE = 8192  # the largest slot; a group's own is self.INLINE

    def _slot(self, data, width):
        t = self._torch
        slot = t.zeros(width, dtype=t.uint8)
        slot[:8] = t.tensor([len(data)], dtype=t.int64).view(t.uint8)
        if data and len(data) <= width - 8:
            slot[8:8 + len(data)] = t.frombuffer(bytearray(data), dtype=t.uint8)
        return slot.to(self._device)

    def _gather_broadcast(self, mine):
        """Every member's `mine` (equal lengths), in the group's rank order, on every member."""
        t, dist, n = self._torch, self._dist, len(self._members)
        root = self._sorted[0]
        out = t.empty(n * mine.numel(), dtype=t.uint8, device=self._device)
        pieces = list(out.chunk(n)) if self._dist.get_rank() == root else None
        _lend(mine, out, *(pieces or []))
        dist.gather(mine, pieces, dst=root, group=self._pg)
        dist.broadcast(out, src=root, group=self._pg)
        return out.view(n, mine.numel()).cpu()

    def all_gather_bytes(self, data):
        t, n = self._torch, len(self._members)
        slots = self._gather_broadcast(self._slot(data, self.INLINE))
        sizes = slots[:, :8].contiguous().view(t.int64).view(-1).tolist()
        longest = max(sizes)
        if longest <= self.INLINE - 8:
            rows, start = slots, 8
        else:
            mine = t.zeros(longest, dtype=t.uint8)
            if data:
                mine[:len(data)] = t.frombuffer(bytearray(data), dtype=t.uint8)
            rows, start = self._gather_broadcast(mine.to(self._device)), 0
        by_group = [bytes(rows[i, start:start + sizes[i]].numpy()) for i in range(n)]
        return [by_group[self._group_rank[i]] for i in range(n)]

    def broadcast_bytes(self, data, root):
        t, dist = self._torch, self._dist
        src = self._members[root]
        slot = _lend(self._slot(data if root == self._rank else b"", self.INLINE))
        dist.broadcast(slot, src=src, group=self._pg)
        slot = slot.cpu()
        size = int(slot[:8].view(t.int64).item())
        if size <= self.INLINE - 8:
            return bytes(slot[8:8 + size].numpy())
        buf = _lend(self._uint8(data) if root == self._rank else t.empty(size, dtype=t.uint8, device=self._device))
        dist.broadcast(buf, src=src, group=self._pg)
        return bytes(buf.cpu().numpy())

    def all_gather_rows(self, rows, bytes_per_member):
        """In place: member i fills bytes_per_member[i] bytes of `rows` (a DLPack capsule of uint8,
        in member order); each broadcasts its share into the others' memory."""
        view = self._torch.utils.dlpack.from_dlpack(rows)
        start = 0
        for i, n in enumerate(bytes_per_member):
            if n:
                self._dist.broadcast(_lend(view[start:start + n]), src=self._members[i], group=self._pg)
            start += n

    def split(self, color, key):
        """The members of `color`, ranked by `key` (collective)."""
        mine = json.dumps([color, key, self._members[self._rank]]).encode()
        everyone = [json.loads(b) for b in self.all_gather_bytes(mine)]
        if self._private is not None:
            if any(c != everyone[0][0] for c, _, _ in everyone):
                raise RuntimeError("TorchGroup.split: a group with a private group splits only into one color")
            order = [g for _, _, g in sorted((k, r, g) for r, (_, k, g) in enumerate(everyone))]
            return TorchGroup(self._private, _members=order)
        if len(self._sorted) != self._world:
            raise RuntimeError("TorchGroup.split: torch.distributed makes a group only with every process of the "
                               "job, so a TorchGroup over a subgroup cannot split; give it a second group of the "
                               "same processes: TorchGroup(pg, private=torch.distributed.new_group(ranks))")
        mine_group = None
        for c in sorted({c for c, _, _ in everyone}):
            order = [g for _, _, g in sorted((k, r, g) for r, (cc, k, g) in enumerate(everyone) if cc == c)]
            backend = self._dist.get_backend(self._pg)
            timeout = {} if self._timeout is None else {"timeout": self._timeout}
            # every process makes every group
            pg = self._dist.new_group(ranks=sorted(order), backend=backend, **timeout)
            if c == color:
                mine_group = TorchGroup(pg, _members=order)
        return mine_group
