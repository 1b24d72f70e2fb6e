"""ShardedParam.shard_of: a rank's padded shard cut from a whole weight. The rows come from the
library's plan of the rank (ShardedParam.source_rows), so the cut is the one a save and a load make;
this file only copies them."""
import sys


def _zeros(like, shape):
    """A zero tensor of `shape` of the framework, dtype and device of `like` (torch or numpy)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(like, np.ndarray):
        return np.zeros(shape, dtype=like.dtype)
    return None


def shard_of(self, weight):
    """This rank's padded shard of `weight`, as a new tensor of the same framework, dtype and device
    (a torch tensor for a torch tensor, a numpy array for a numpy array): its real rows copied from
    `weight`, its pad rows zero; for a ShardedParam with `flat=(begin, end)`, that range of it.

    `weight` is either the weight without TP (TP=1: the blocks of a fused weight one after another at
    their global rows, a row-parallel weight with all its columns; shape ParamSpec.global_shape()) or
    this TP rank's weight before GTP (shape ParamSpec.local_shape()). The shape tells which: at TP > 1
    the two differ (except for a replicated weight, whose TP rank holds all of it, and at TP 1, where
    they are the same weight). A fused weight without TP gives each TP rank its rows of every block,
    as a save at TP=1 stores them. Another shape is a ValueError naming both."""
    spec = self.spec
    out = _zeros(weight, self.padded_shape())
    if out is None:
        raise TypeError(f"{spec.key}: shard_of takes a torch tensor or a numpy array, not a {type(weight).__name__}")
    shape = tuple(weight.shape)
    if shape == spec.global_shape():
        runs = self.source_rows(tp_local=False)
    elif shape == spec.local_shape():
        runs = self.source_rows(tp_local=True)
    else:
        raise ValueError(f"{spec.key}: a weight of shape {list(shape)} is neither the weight without TP "
                         f"{list(spec.global_shape())} (ParamSpec.global_shape()) nor TP rank {self.tp_rank}'s weight "
                         f"{list(spec.local_shape())} at TP {spec.tp} (ParamSpec.local_shape())")
    for shard_begin, shard_end, row_begin, row_end, cols in runs:
        rows = weight[row_begin:row_end]
        out[shard_begin:shard_end] = rows if cols is None else rows[:, cols[0]:cols[1]]
    if self.flat is not None:
        begin, end = self.flat
        part = out.reshape(-1)[begin:end]
        out = part.clone() if hasattr(part, "clone") else part.copy()
    return out
