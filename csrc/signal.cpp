#include "signal.hpp"

#include <algorithm>

namespace shmvec {

int64_t AdaptiveSpin::budget_ns(int64_t now_ns) {
  if (now_ns < backoff_until_ns_) return 0;
  if (mean_ns_ > static_cast<double>(max_ns_)) return min_ns_;
  const int64_t want = std::max(static_cast<int64_t>(2.0 * mean_ns_) + min_ns_, kSleepCostNs);
  return std::clamp(want, min_ns_, max_ns_);
}

void AdaptiveSpin::preempted(int64_t now_ns) {
  const bool again = now_ns - backoff_until_ns_ <= backoff_ns_;
  backoff_ns_ = again ? std::min(2 * backoff_ns_, kBackoffMaxNs) : kBackoffMinNs;
  backoff_until_ns_ = now_ns + backoff_ns_;
}

void AdaptiveSpin::observe(int64_t waited_ns) {
  // Cap each sample so one long pause (a checkpoint, an evaluation) moves the
  // mean by at most half the cap: a few short waits bring spinning back.
  const double sample = static_cast<double>(std::min(waited_ns, 4 * max_ns_));
  mean_ns_ += 0.125 * (sample - mean_ns_);
}

}  // namespace shmvec
