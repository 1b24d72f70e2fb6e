// rejects: no matching constructor for initialization of 'StagingPool'
// A staging pool shares the ownership of its engine: it cannot be made over a reference that could
// dangle.
import shardckpt;
using namespace shardckpt;

void f(EmulatedDevice& engine) { StagingPool pool(engine, 4096); }
