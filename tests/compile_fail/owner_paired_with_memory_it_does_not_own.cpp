// rejects: no matching constructor for initialization of 'SharedBuffer'
// A shared buffer views memory inside the allocation it shares, never any pointer beside any owner.
#include <memory>
import shardckpt;
using namespace shardckpt;

SharedBuffer f(std::shared_ptr<void> owner, MutTensorView other) { return SharedBuffer(owner, other); }
