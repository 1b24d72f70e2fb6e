// rejects: no viable conversion
// Options share what they refer to (a pool, an engine): a raw pointer in them could dangle silently.
import shardckpt;
using namespace shardckpt;

LoadOptions f(StagingPool& pool) { return LoadOptions{.staging = &pool}; }
