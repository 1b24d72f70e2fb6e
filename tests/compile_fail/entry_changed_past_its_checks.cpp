// rejects: no viable overloaded '='
// A state dict's entries stay as add() checked them: renaming one afterwards (two entries under one
// key) does not compile; only an entry's memory is the owner's to change (mut_data, mut_shard).
import shardckpt;
using namespace shardckpt;

void f(StateDict& s) { s.params()[0].spec.key = s.tensors()[0].key; }
