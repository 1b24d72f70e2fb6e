// rejects: no viable overloaded '='
// A factory's shard must be owned or explicitly borrowed, not a bare view.
import shardckpt;
using namespace shardckpt;

void f(ShardedParam& p, const HostBuffer& b) { p.shard = b.view(); }
