// rejects: calling a private constructor of class 'shardckpt::BasicView<false>'
// Memory of one dtype is not silently seen as another: a view's dtype is fixed when it is made, and
// the one way to see its bytes as another dtype is reinterpreted_as, which checks sizes and alignment.
import shardckpt;
using namespace shardckpt;

TensorView f(TensorView v) { return TensorView(v.data(), DType::f32, v.shape(), v.space()); }
