// Storage of the test hooks (csrc/test_hooks.hpp), linked only into the tests.
#include "test_hooks.hpp"

namespace shmvec::test_hooks {
void (*between_publish_and_count)(uint32_t worker) = nullptr;
int64_t front_slice_ns = 0;
}  // namespace shmvec::test_hooks
