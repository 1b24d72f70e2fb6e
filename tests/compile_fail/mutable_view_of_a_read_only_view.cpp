// rejects: no viable conversion from returned value of type 'const BasicView<false>'
import shardckpt;
using namespace shardckpt;

MutTensorView f(const TensorView& v) { return v; }
