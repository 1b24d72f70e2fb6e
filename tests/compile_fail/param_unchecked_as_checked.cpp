// rejects: calling a private constructor of class 'shardckpt::CheckedParam'
// A CheckedParam is made only by check_param: a parameter cannot skip StateDict::add's checks by
// calling itself checked.
#include <utility>
import shardckpt;
using namespace shardckpt;

void f(StateDict& state, ShardedParam p) { state.add(CheckedParam(std::move(p), 0)); }
