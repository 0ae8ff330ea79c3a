// Signalling between processes through words in shared memory: spin for a
// bounded, adaptive time, then sleep on a futex in timed slices.
//
// Protocol (one writer per word): the waiter announces itself in a `sleeping`
// word before it sleeps; the publisher wakes only if it sees that flag. The
// waiter's (store sleeping, load word) and the publisher's (store word, load
// sleeping) are all seq_cst: of two such store-then-load pairs at least one
// load sees the other side's store, so either the waiter sees the new value or
// the publisher sees the flag and wakes it. With weaker orderings both loads
// could read stale values and the wake-up would be lost until the next slice.
#pragma once

#include <atomic>
#include <climits>
#include <cstdint>

#include "platform.hpp"

namespace shmvec {

// A spin budget derived from how long recent waits took. If the peer usually
// answers within the cap, spin a little longer than it usually takes; if it
// usually takes longer than the cap, spinning is wasted CPU (and steals a core
// from the peer on small machines), so sleep almost at once.
//
// When a spin finds its core taken by another thread (more runnable threads
// than cores: a busy machine, or more workers than CPUs), spinning only
// delays whoever we wait for: waits sleep at once for a window, then
// spinning is tried again. A loss within one window's length of the last
// window's end doubles the window (up to kBackoffMaxNs); one after a longer
// calm starts again from kBackoffMinNs. On a core shared with a CPU hog each
// retry costs dearly: its yield hands the hog the core until the next
// scheduler tick (up to 4 ms at HZ=250), and its spinning spends the credit
// that lets a woken thread preempt the hog at once.
// Time the hypervisor takes from a virtual CPU is not a loss: no thread of
// ours or of anyone else's wanted the core, and sleeping would only add a
// wake-up to every wait.
//
// While waits are usually short, the budget is at least kSleepCostNs, about
// what a sleep can cost on a VM: the futex wake-up and the halted vCPU's
// return take tens of microseconds on a calm host, and far longer in its slow
// stretches, when the woken vCPU waits for a turn on the host. A wait a few
// times longer than the mean (an env's episode reset, a hypervisor hiccup, a
// front end copying Atari frames) then keeps spinning instead of paying for a
// wake-up. On the 2-vCPU VMs a floor of 100 us took CartPole x64 from 0.905
// to 0.93 of the limit (medians of 4 paired runs, shmvec bench --num-envs 64
// --passes 1); 1 ms, with the cap (kSpinCapNs) raised from 200 us to 2 ms,
// took Pong x16 1.07x-1.13x further, where the caller had slept in 0.24 of
// its batches' waits and the worker in 0.43 (docs/performance.md).
class AdaptiveSpin {
 public:
  static constexpr int64_t kBackoffMinNs = 2'000'000;
  static constexpr int64_t kBackoffMaxNs = 1'000'000'000;
  static constexpr int64_t kSleepCostNs = 1'000'000;
  // Waits whose mean is longer than this sleep almost at once.
  static constexpr int64_t kSpinCapNs = 2'000'000;
  AdaptiveSpin(int64_t min_ns, int64_t max_ns) : min_ns_(min_ns), max_ns_(max_ns) {}
  int64_t budget_ns(int64_t now_ns);  // for a wait starting at now_ns
  void observe(int64_t waited_ns);
  void preempted(int64_t now_ns);  // a spin lost its core at now_ns

 private:
  int64_t min_ns_, max_ns_;
  double mean_ns_ = 0.0;
  int64_t backoff_ns_ = 0;                   // length of the last window
  int64_t backoff_until_ns_ = INT64_MIN / 2;  // its end
};

// When a worker's waits are long (the caller spends milliseconds between
// steps: a policy on a GPU, a gradient step after every step) and steady,
// sleeping through them and being woken by the next command puts the
// wake-up on the step's path: on the 2-vCPU VMs a sleeping worker took
// 0.16-0.23 ms to notice a command in SB3's SAC loop, about what its two
// HalfCheetahs then took (docs/performance.md). So the
// worker dozes: it sleeps on a timer until a lead before the shortest of its
// last kWindow waits would end, then spins for the command. The timer's
// wake-up is paid in the gap; the spin costs the lead plus the waits' spread.
// How late the timer fires is learnt and sets the lead. Waits shorter than
// the spin cap are spun through anyway; longer than kMaxDozeNs, a wake-up is
// a small share. Where that spin loses its core (the caller's torch threads
// still computing, or spinning after their last op, on the worker's CPU),
// it only takes time from them: after kLossesInARow such losses (one alone
// comes now and then on a VM) dozing stops for a window that doubles each
// time (from kDozeBackoffMinNs) and shrinks back after a doze that kept its
// core.
class WakeForecast {
 public:
  static constexpr int kWindow = 8;
  static constexpr int64_t kMaxDozeNs = 100'000'000;
  static constexpr int64_t kMinLeadNs = 100'000;
  static constexpr int64_t kMaxLeadNs = 1'000'000;
  static constexpr int64_t kDozeBackoffMinNs = 100'000'000;
  static constexpr int64_t kDozeBackoffMaxNs = 60'000'000'000;
  static constexpr int kLossesInARow = 2;
  void observe(int64_t waited_ns);  // how long a wait took, until the command was posted
  // How long to sleep at the start of a wait at now_ns; 0: do not doze.
  int64_t doze_ns(int64_t now_ns) const;
  // How long to spin after a doze that ran its full length.
  int64_t spin_after_doze_ns() const;
  void woke_late(int64_t late_ns);  // a doze's timer fired this long after its end
  // After a doze's spin: whether it lost its core, at now_ns.
  void spun(bool lost_core, int64_t now_ns);

 private:
  int64_t lead_ns() const;
  int64_t waits_[kWindow] = {};
  int count_ = 0, next_ = 0;
  double late_ns_ = 50'000;  // mean lateness of the doze's timer
  int losses_ = 0;  // dozes in a row whose spin lost its core
  int64_t backoff_ns_ = kDozeBackoffMinNs / 2;
  int64_t backoff_until_ns_ = INT64_MIN / 2;
};

// Stores `value` in `word` and wakes sleepers if any announced themselves.
inline void publish(std::atomic<uint32_t>& word, uint32_t value,
                    const std::atomic<uint32_t>& sleeping) {
  word.store(value, std::memory_order_seq_cst);
  if (sleeping.load(std::memory_order_seq_cst)) platform::futex_wake(&word, INT_MAX);
}

// Waits until ready(value of word) holds. Spins for `spin_ns`, then sleeps in
// slices of `slice_ns`; after each slice calls on_slice(), which returns false
// to give up (timeout, dead peer, pending signal). Returns whether ready.
// Before each sleep, announce(seen) may tell the publisher what we wait for;
// what it stores is released by the store of `sleeping` that follows.
// Memory order: `ready` is evaluated on acquire loads, so whatever the
// publisher wrote before its release (or seq_cst) store is visible after.
// If `preempted` is given, it is set when the spin lost its core to another
// thread (see AdaptiveSpin), also when the word was ready by the time the
// spin got its core back; a wait not ready by then sleeps at once.
constexpr int64_t kPureSpinNs = 3'000;
// A gap this long between two checks of a spin (a check takes about a
// microsecond, a yield to nobody too) means the core was taken from us: by
// another thread if we were switched out meanwhile, else by the hypervisor
// (on a busy host, several times a second), which is no reason to stop
// spinning. Switches are counted around each yield, where a syscall is paid
// anyway. A gap before the first yield, where none was counted yet, is taken
// for the hypervisor's: such gaps come several times a second on a VM, and a
// worker whose waits mostly end within kPureSpinNs (cheap envs) met them
// often enough, when they counted as lost cores, to keep doubling its
// back-off and sleep through most waits (NoopEnv x8 on two vCPUs, one
// second in each of many fresh processes: half speed in 23 of 95 before,
// 2 of 117 since; bench/worker_sleeps.py). A real loss that early
// is still seen if the wait goes on past its first yield.
constexpr int64_t kPreemptedNs = 50'000;

template <class Ready, class OnSlice, class Announce>
bool wait_until(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleeping, Ready ready,
                int64_t spin_ns, int64_t slice_ns, OnSlice on_slice, Announce announce,
                bool* preempted = nullptr) {
  if (ready(word.load(std::memory_order_acquire))) return true;
  const int64_t start = platform::now_ns();
  int64_t now = start;
  int64_t switches = -1;  // before the last yield; -1: not read yet
  do {
    bool is_ready = false;
    for (int k = 0; k < 16 && !is_ready; ++k) {
      platform::cpu_relax();
      is_ready = ready(word.load(std::memory_order_acquire));
    }
    // Look for a lost core even when the word is ready: the peer we wait for
    // may be the thread that took it, and publish while holding it.
    const int64_t before = now;
    now = platform::now_ns();
    if (now - before > kPreemptedNs && switches >= 0 && platform::involuntary_switches() != switches) {
      if (preempted) *preempted = true;
      break;
    }
    if (is_ready) return true;
    // Past the first few microseconds, offer the core between checks: if the
    // peer we wait for shares it (more runnable processes than cores), it
    // runs now instead of after our whole budget; if not, this costs ~1 us.
    if (now - start > kPureSpinNs) {
      switches = platform::involuntary_switches();
      platform::yield_cpu();
    }
  } while (now - start < spin_ns);

  for (;;) {
    const uint32_t seen = word.load(std::memory_order_seq_cst);
    if (ready(seen)) return true;
    announce(seen);
    sleeping.store(1, std::memory_order_seq_cst);
    // Sleep only if the word has not moved since `seen` (if it has, look
    // again): a publisher that stored after this load sees `sleeping` and
    // wakes us, and futex_wait returns at once if it stored before we slept.
    if (word.load(std::memory_order_seq_cst) == seen) platform::futex_wait(&word, seen, slice_ns);
    sleeping.store(0, std::memory_order_relaxed);
    if (ready(word.load(std::memory_order_acquire))) return true;
    if (!on_slice()) return false;
  }
}

template <class Ready, class OnSlice>
bool wait_until(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleeping, Ready ready,
                int64_t spin_ns, int64_t slice_ns, OnSlice on_slice, bool* preempted = nullptr) {
  return wait_until(word, sleeping, ready, spin_ns, slice_ns, on_slice, [](uint32_t) {}, preempted);
}

}  // namespace shmvec
