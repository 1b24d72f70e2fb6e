"""The bench's model, as shardckpt-bench builds it (bench/model.cpp, src/demo.cpp): GDP and Mamba
layers 3:1, each with a fused in_proj and conv1d, a row-parallel out_proj (TP on dim 1) and a
replicated norm, bf16, hidden 2,048, heads 32 x 128, groups 8, state 128, 2 Householder steps, as many
layers as bring the bytes closest to the target. Element i (row-major, in its block's dataset) of
every block is (fnv1a32(key) + i) mod 2^24 in bf16, so that any rank at any layout builds or checks
its own rows alone.

A rank's pieces: GTP cuts a TP rank's weight into padded row shards (ShardedParam.padded_shape()
rows each, real rows first); each block (fused section) a shard crosses is one piece, a shard of the
block's global tensor at its global offset. That is what every side saves: shardckpt from the padded
shard itself, DCP and safetensors from views of it.
"""
from dataclasses import dataclass, field
from math import prod

import torch

import shardckpt as sc

DIMS = dict(heads=32, head_dim=128, groups=8, state=128, householder=2)
COLS, CONV_KERNEL = 2048, 4
ELEMENT_BYTES = 2  # bf16


@dataclass(frozen=True)
class Layout:
    tp: int
    gtp: int
    align: int

    def ranks(self):
        return self.tp * self.gtp

    def coord(self, rank):
        return rank // self.gtp, rank % self.gtp  # (TP rank, GTP rank), as the C++ bench numbers them

    def text(self):
        return f"TP {self.tp} x GTP {self.gtp} (alignment {self.align})"


@dataclass(frozen=True)
class Config:
    gdp_layers: int
    mamba_layers: int
    cols: int = COLS

    def dims(self):
        return sc.SsmDims(**DIMS)

    def layers(self):
        return self.gdp_layers + self.mamba_layers


def specs(config, tp):
    """Every parameter of the model at TP degree `tp` (demo::params)."""
    dims, d_inner = config.dims(), DIMS["heads"] * DIMS["head_dim"]
    out = []
    for layer in range(config.layers()):
        gdp, key = layer < config.gdp_layers, f"decoder.layers.{layer}."
        in_proj = sc.gdp_in_proj_sections if gdp else sc.mamba_in_proj_sections
        conv1d = sc.gdp_conv1d_sections if gdp else sc.mamba_conv1d_sections
        out.append(sc.ParamSpec(key + "mixer.in_proj.weight", in_proj(dims, tp), [config.cols], tp=tp))
        out.append(sc.ParamSpec(key + "mixer.conv1d.weight", conv1d(dims, tp), [1, CONV_KERNEL], tp=tp))
        out.append(sc.ParamSpec(key + "mixer.out_proj.weight", sc.plain_sections(config.cols), [d_inner // tp],
                                tp_axis="cols", tp=tp))
        out.append(sc.ParamSpec(key + "norm.weight", sc.plain_sections(config.cols), [], tp_axis="replicated", tp=tp))
    return out


def model_bytes(config):
    return sum(s.rows() * prod(s.trailing) for s in specs(config, 1)) * ELEMENT_BYTES


def bench_config(target_bytes):
    """GDP and Mamba layers (3:1), as many as bring the bytes closest to the target (bench_config)."""
    def with_layers(layers, cols):
        return Config(layers - layers // 4, layers // 4, cols)
    cols = COLS
    while cols > 256 and model_bytes(with_layers(2, cols)) > target_bytes:
        cols //= 2
    best, gap, layers = 1, None, 1
    while True:
        b = model_bytes(with_layers(layers, cols))
        if gap is None or abs(b - target_bytes) < gap:
            best, gap = layers, abs(b - target_bytes)
        if b > target_bytes:
            break
        layers += 1
    return with_layers(best, cols)


def block_key(spec, section):
    return f"{spec.key}.{section.name}" if section.name else spec.key


def block_shape(spec, section):
    shape = [section.rows * (spec.tp if spec.tp_axis == "rows" else 1), *spec.trailing]
    if spec.tp_axis == "cols":
        shape[1] *= spec.tp
    return tuple(shape)


@dataclass(frozen=True)
class Piece:
    key: str            # the block's key: its dataset in shardckpt, its tensor in DCP
    global_shape: tuple
    offset: tuple       # where the piece starts in the block's global tensor
    size: tuple         # the piece's shape
    shard_row: int      # its first row in the rank's padded shard
    replica: int        # 0 for the copy a save writes (the replicated norm: TP rank 0's)

    def rows(self):
        return self.size[0]


def pieces(spec, gtp, align, tp_rank, gtp_rank):
    """The pieces of one rank's padded shard of `spec`, and that ShardedParam."""
    param = sc.ShardedParam(spec, gtp=gtp, align=align, tp_rank=tp_rank, gtp_rank=gtp_rank, dtype=torch.bfloat16)
    first = param.padded_shape()[0] * gtp_rank
    last = first + param.real_rows()
    out, start = [], 0
    for section in spec.sections:
        lo, hi = max(first, start), min(last, start + section.rows)
        if lo < hi:
            row = lo - start + (tp_rank * section.rows if spec.tp_axis == "rows" else 0)
            offset = [row] + [0] * len(spec.trailing)
            size = [hi - lo, *spec.trailing]
            if spec.tp_axis == "cols":
                offset[1] = tp_rank * spec.trailing[0]
            out.append(Piece(block_key(spec, section), block_shape(spec, section), tuple(offset), tuple(size),
                             lo - first, tp_rank if spec.tp_axis == "replicated" else 0))
        start += section.rows
    return param, out


def fnv1a32(text):
    h = 2166136261
    for b in text.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def pattern(piece):
    """The piece's values: element i of its block is (fnv1a32(key) + i) mod 2^24, in bf16."""
    shape = piece.global_shape
    row_elems = prod(shape[1:])
    col0 = piece.offset[1] * prod(shape[2:]) if len(shape) > 1 else 0
    width = prod(piece.size[1:])
    rows = torch.arange(piece.offset[0], piece.offset[0] + piece.rows(), dtype=torch.int64)[:, None]
    index = rows * row_elems + (col0 + fnv1a32(piece.key)) + torch.arange(width, dtype=torch.int64)[None, :]
    return index.remainder_(1 << 24).to(torch.float32).to(torch.bfloat16).reshape(piece.size)


@dataclass
class RankParam:
    spec: object
    param: object          # shardckpt.ShardedParam, its shard not set
    shard: torch.Tensor    # the padded shard
    pieces: list

    def view(self, piece):
        """The piece's rows of the shard, in place."""
        return self.shard[piece.shard_row:piece.shard_row + piece.rows()]


@dataclass
class RankModel:
    layout: Layout
    rank: int
    params: list = field(default_factory=list)

    def shard_bytes(self):
        return sum(p.shard.numel() * p.shard.element_size() for p in self.params)


def rank_model(config, layout, rank, fill=True):
    """One rank's padded shards at `layout`: the pattern in real rows and zero pad rows (fill), or
    destinations whose every byte is 0xff, as a trainer's model is before a load (touched once)."""
    tp_rank, gtp_rank = layout.coord(rank)
    model = RankModel(layout, rank)
    for spec in specs(config, layout.tp):
        param, ps = pieces(spec, layout.gtp, layout.align, tp_rank, gtp_rank)
        shard = torch.zeros(param.padded_shape(), dtype=torch.bfloat16) if fill else \
            torch.full(param.padded_shape(), -1, dtype=torch.int16).view(torch.bfloat16)
        for p in ps if fill else ():
            shard[p.shard_row:p.shard_row + p.rows()] = pattern(p)
        model.params.append(RankParam(spec, param, shard, ps))
    return model


def poison(model):
    """Every byte of every destination 0xff again, so that a load must write every one."""
    for p in model.params:
        p.shard.view(torch.int16).fill_(-1)


def all_pieces(config, layout):
    """Every rank's pieces, by block key: [(rank, piece)], for DCP's global shard metadata."""
    out = {}
    for rank in range(layout.ranks()):
        tp_rank, gtp_rank = layout.coord(rank)
        for spec in specs(config, layout.tp):
            for piece in pieces(spec, layout.gtp, layout.align, tp_rank, gtp_rank)[1]:
                out.setdefault(piece.key, []).append((rank, piece))
    return out


def mismatches(model, expected, pad_rows_zero):
    """Rows of `model`'s shards (after a load) that differ from `expected` (the same layout, filled
    with the pattern): real rows always, pad rows only where the loader zeroes them (shardckpt)."""
    bad = []
    for got, want in zip(model.params, expected.params):
        real = sum(p.rows() for p in want.pieces)
        g, w = got.shard.view(torch.int16), want.shard.view(torch.int16)
        if not torch.equal(g[:real], w[:real]):
            bad.append(f"{got.spec.key}: real rows differ")
        if pad_rows_zero and not bool((g[real:] == 0).all()):
            bad.append(f"{got.spec.key}: pad rows are not zero")
    return bad
