// rejects: cannot assign to return value because function 'operator[]' returns a const value
// A parameter's layout stays as add() checked it: its GTP size, alignment and coordinates are not
// the owner's to change past the checks (a shard's shape depends on them).
import shardckpt;
using namespace shardckpt;

void f(StateDict& s) { s.params()[0].gtp = 3; }
