// rejects: no member named 'borrow'
// A view of a raw pointer is a named unchecked operation (TensorView::unchecked), not a plain borrow.
import shardckpt;
using namespace shardckpt;

TensorView f(const float* p) { return TensorView::borrow(p, DType::f32, {4}); }
