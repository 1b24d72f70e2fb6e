"""shardckpt through its Python package, in the same processes: each rank's padded shards in a
StateDict (the tensors themselves, through DLPack), TorchGroup over torch.distributed's gloo group."""
import shardckpt as sc


def state_dict(model):
    """The rank's ShardedParams, each holding its padded shard in place."""
    state = sc.StateDict()
    for rp in model.params:
        p = sc.ShardedParam(rp.spec, gtp=model.layout.gtp, align=model.layout.align, tp_rank=rp.param.tp_rank,
                            gtp_rank=rp.param.gtp_rank, shard=rp.shard)
        state.add(p)
    state.add_common("iteration", 1000)
    return state


def save(state, path, group):
    sc.save(state, path, group)


def load(state, path, group):
    sc.load_into(path, state, group)  # in place: every shard filled, pad rows zeroed


class AsyncSaver:
    """A Saver made once, as a trainer's is: save_async returns once the rank's rows are staged."""

    def __init__(self, group):
        self.saver = sc.Saver(group)

    def save_async(self, state, path):
        return self.saver.save_async(state, path)

    def staging_bytes(self):
        return self.saver.staging_bytes()

    def close(self):
        pass
