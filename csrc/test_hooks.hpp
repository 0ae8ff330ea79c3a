// Test-only hooks into the protocol, compiled in only with
// -DSHMVEC_TEST_HOOKS (the native tests' build of the core, never the
// extension): with it off every hook is an empty inline function.
#pragma once

#include <cstdint>

namespace shmvec::test_hooks {

#ifdef SHMVEC_TEST_HOOKS
// Set by a test before its threads start; called by WorkerChannel::complete()
// between publishing done_id and counting the completion, to widen that gap.
extern void (*between_publish_and_count)(uint32_t worker);
// When > 0, replaces the front end's 20 ms sleep slice, so that a lost wake-up
// costs an unmistakable time (written only by the thread running the front end).
extern int64_t front_slice_ns;

inline void on_between_publish_and_count(uint32_t worker) {
  if (between_publish_and_count) between_publish_and_count(worker);
}
inline int64_t front_slice(int64_t release_ns) { return front_slice_ns > 0 ? front_slice_ns : release_ns; }
#else
inline void on_between_publish_and_count(uint32_t) {}
constexpr int64_t front_slice(int64_t release_ns) { return release_ns; }
#endif

}  // namespace shmvec::test_hooks
