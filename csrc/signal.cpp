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

void WakeForecast::observe(int64_t waited_ns) {
  waits_[next_] = waited_ns;
  next_ = (next_ + 1) % kWindow;
  count_ = std::min(count_ + 1, kWindow);
}

int64_t WakeForecast::lead_ns() const {
  return std::clamp(static_cast<int64_t>(2.0 * late_ns_) + kMinLeadNs / 2, kMinLeadNs, kMaxLeadNs);
}

int64_t WakeForecast::doze_ns(int64_t now_ns) const {
  if (count_ < kWindow || now_ns < backoff_until_ns_) return 0;
  const auto [lo, hi] = std::minmax_element(waits_, waits_ + kWindow);
  if (*lo < AdaptiveSpin::kSpinCapNs || *hi > kMaxDozeNs) return 0;
  return *lo - lead_ns();
}

int64_t WakeForecast::spin_after_doze_ns() const {
  const auto [lo, hi] = std::minmax_element(waits_, waits_ + kWindow);
  return std::min(*hi - *lo + 2 * lead_ns(), AdaptiveSpin::kSpinCapNs);
}

void WakeForecast::woke_late(int64_t late_ns) {
  const double sample = static_cast<double>(std::clamp<int64_t>(late_ns, 0, kMaxLeadNs));
  late_ns_ += 0.25 * (sample - late_ns_);
}

void WakeForecast::spun(bool lost_core, int64_t now_ns) {
  if (!lost_core) {
    losses_ = 0;
    backoff_ns_ = std::max(backoff_ns_ / 2, kDozeBackoffMinNs / 2);
    return;
  }
  if (++losses_ < kLossesInARow) return;
  losses_ = 0;
  backoff_ns_ = std::min(2 * backoff_ns_, kDozeBackoffMaxNs);
  backoff_until_ns_ = now_ns + backoff_ns_;
}

}  // namespace shmvec
