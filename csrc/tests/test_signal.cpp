// Native tests of the core, no Python: commands and completions between a
// front end and forked workers over a memfd arena (many round trips, so a
// lost wake-up shows up as a timeout), async rings, the spin budget, what a
// spin takes for a lost core, and SIGINT held while the caller steps envs.
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "arena.hpp"
#include "channel.hpp"
#include "platform.hpp"
#include "signal.hpp"

using namespace shmvec;

#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

namespace {

constexpr uint32_t kWorkers = 2;
constexpr uint32_t kEnvs = 6;
constexpr uint32_t kRounds = 20000;
constexpr uint32_t kQuit = 99;

struct Arena {
  int fd;
  char* base;
  FixedLayout fixed{kWorkers, 256, 256};
  std::size_t async_offset;
};

Arena make_arena() {
  Arena a;
  a.async_offset = a.fixed.size();
  // Room for a pair of rings per worker and one for the caller's own slice.
  const std::size_t size = a.async_offset + AsyncRegion::size(kEnvs, kWorkers + 1, 64);
  a.fd = platform::create_shared_file(size);
  CHECK(a.fd >= 0);
  a.base = static_cast<char*>(platform::map_shared(a.fd, size));
  CHECK(a.base != nullptr);
  return a;
}

// A worker: completes each command with status = its code, and steps async
// rows by pushing them back as finished.
[[noreturn]] void worker_main(const Arena& a, uint32_t w, int parent_fd) {
  WorkerChannel ch(a.base, a.fixed, w, parent_fd);
  ch.attach_async(AsyncRegion(a.base + a.async_offset, kEnvs, kWorkers, 64));
  for (;;) {
    uint32_t row;
    while (ch.pop_todo(&row)) ch.push_finished(row);
    if (!ch.take_command()) {
      if (!ch.wait_doorbell()) _exit(2);  // parent gone
      continue;
    }
    const uint32_t code = ch.control_of().command.code;
    ch.complete(static_cast<int32_t>(code), 0, 0);
    if (code == kQuit) _exit(0);
  }
}

bool never_interrupted() { return false; }

// Forks worker 0 of `a`; `parent_pipe` gets the pipe whose write end, held
// by this process alone, tells the worker its parent is alive.
pid_t fork_worker0(const Arena& a, int parent_pipe[2]) {
  CHECK(pipe(parent_pipe) == 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(parent_pipe[1]);
    worker_main(a, 0, parent_pipe[0]);
  }
  close(parent_pipe[0]);
  return pid;
}

void test_commands_and_async() {
  Arena a = make_arena();
  FrontChannel front(a.base, a.fixed, true);
  std::vector<uint32_t> owner = {0, 0, 0, 1, 1, 1};
  front.attach_async(AsyncRegion(a.base + a.async_offset, kEnvs, kWorkers, 64), owner);
  int pipe_fds[2];
  CHECK(pipe(pipe_fds) == 0);
  std::vector<pid_t> pids;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    pid_t pid = fork();
    if (pid == 0) {
      close(pipe_fds[1]);
      worker_main(a, w, pipe_fds[0]);
    }
    pids.push_back(pid);
  }
  close(pipe_fds[0]);
  // Sentinels: nothing to poll for liveness here; an fd that never gets ready.
  int never[2];
  CHECK(pipe(never) == 0);
  std::vector<int> sentinels(kWorkers, never[0]);

  const std::vector<uint32_t> all = {0, 1};
  for (uint32_t i = 1; i <= kRounds; ++i) {
    const uint32_t code = 10 + i % 50;
    front.post(all, code, 0, {});
    const int status = front.wait(sentinels, 10.0, never_interrupted);
    if (status != kReady) std::fprintf(stderr, "round %u: wait status %d\n", i, status);
    CHECK(status == kReady);
    for (uint32_t w = 0; w < kWorkers; ++w) CHECK(front.control_of(w).result.status == static_cast<int32_t>(code));
    // Every few rounds, a batch of async work between commands.
    if (i % 7 == 0) {
      front.send({5, 0, 3});
      CHECK(front.wait_finished(3, sentinels, 10.0, never_interrupted) == kReady);
      std::vector<uint32_t> rows = front.pop_finished(3);
      CHECK(rows.size() == 3);
      std::vector<int> seen(kEnvs, 0);
      for (uint32_t r : rows) seen[r]++;
      CHECK(seen[5] == 1 && seen[0] == 1 && seen[3] == 1);
      CHECK(front.finished_ready() == 0);
    }
  }
  front.post(all, kQuit, 0, {});
  CHECK(front.wait(sentinels, 10.0, never_interrupted) == kReady);
  for (pid_t pid : pids) {
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  close(pipe_fds[1]);
  std::printf("commands and async rings: %u round trips ok\n", kRounds);
}

// Both workers' channels in this process, on `region`'s rings: a test pops
// and pushes for them (their parent pipe never hangs up).
struct InProcessWorkers {
  int never[2];
  std::unique_ptr<WorkerChannel> w0, w1;
  InProcessWorkers(const Arena& a, const AsyncRegion& region) {
    CHECK(pipe(never) == 0);
    w0 = std::make_unique<WorkerChannel>(a.base, a.fixed, 0, never[0]);
    w1 = std::make_unique<WorkerChannel>(a.base, a.fixed, 1, never[0]);
    w0->attach_async(region);
    w1->attach_async(region);
  }
  ~InProcessWorkers() {
    close(never[0]);
    close(never[1]);
  }
};

// recv() hands out the envs that finished first, across workers: the
// oldest tickets, each worker's in its ring's order, however many more have
// finished. Two worker channels in this process push in an interleaved
// order; pops of various sizes must give back exactly that order.
void test_pop_finished_takes_the_oldest_across_workers() {
  Arena a = make_arena();
  FrontChannel front(a.base, a.fixed, true);
  std::vector<uint32_t> owner = {0, 0, 0, 1, 1, 1};
  const AsyncRegion region(a.base + a.async_offset, kEnvs, kWorkers, 64);
  front.attach_async(region, owner);
  InProcessWorkers workers(a, region);
  WorkerChannel &w0 = *workers.w0, &w1 = *workers.w1;
  const std::vector<uint32_t> order = {4, 0, 1, 5, 3, 2};  // finishing order: rows 0-2 are worker 0's
  for (int round = 0; round < 50; ++round) {
    front.send(std::vector<uint32_t>{0, 1, 2, 3, 4, 5});
    uint32_t row;
    std::vector<uint32_t> todo0, todo1;
    while (w0.pop_todo(&row)) todo0.push_back(row);
    while (w1.pop_todo(&row)) todo1.push_back(row);
    CHECK(todo0.size() == 3 && todo1.size() == 3);
    for (uint32_t r : order) (r < 3 ? w0 : w1).push_finished(r);
    CHECK(front.finished_ready() == 6);
    // Taken in pieces of 1, 2 and 3 (varied by round), always oldest first.
    std::vector<uint32_t> got;
    const uint32_t first = 1 + round % 3;
    for (uint32_t r : front.pop_finished(first)) got.push_back(r);
    CHECK(front.finished_ready() == 6 - first);
    for (uint32_t r : front.pop_finished(6 - first)) got.push_back(r);
    CHECK(got == order);
    CHECK(front.finished_ready() == 0);
  }
  std::printf("pop_finished: oldest first across workers, in pieces: ok\n");
}

// The caller's own slice (async mode) has the pair of rings after the
// workers': send() queues its envs there without ringing anyone, the front
// end pops and pushes them itself, and pop_finished() merges them with the
// workers' by ticket.
void test_callers_own_ring_merges_with_the_workers() {
  Arena a = make_arena();
  FrontChannel front(a.base, a.fixed, true);
  const std::vector<uint32_t> owner = {0, 0, 1, 1, 2, 2};  // 2: the caller's own slice
  const AsyncRegion region(a.base + a.async_offset, kEnvs, kWorkers + 1, 64);
  bool refused = false;
  try {
    front.attach_async(AsyncRegion(a.base + a.async_offset, kEnvs, kWorkers + 2, 64), {0, 0, 1, 1, 3, 3});
  } catch (const std::invalid_argument&) {
    refused = true;  // one pair of rings beyond the workers' at most
  }
  CHECK(refused);
  front.attach_async(region, owner);
  InProcessWorkers workers(a, region);
  WorkerChannel &w0 = *workers.w0, &w1 = *workers.w1;
  const std::vector<uint32_t> order = {4, 0, 5, 2, 1, 3};  // finishing order
  for (int round = 0; round < 50; ++round) {
    front.send(std::vector<uint32_t>{5, 0, 1, 2, 3, 4});
    CHECK(front.own_pending() == 2);
    uint32_t row, own[2];
    CHECK(front.pop_own(&own[0]) && front.pop_own(&own[1]) && !front.pop_own(&row));
    CHECK(own[0] == 5 && own[1] == 4);  // in the order sent
    CHECK(front.own_pending() == 0);
    std::vector<uint32_t> todo;
    while (w0.pop_todo(&row)) todo.push_back(row);
    while (w1.pop_todo(&row)) todo.push_back(row);
    CHECK((todo == std::vector<uint32_t>{0, 1, 2, 3}));
    for (uint32_t r : order) {
      if (r >= 4) front.push_own(r);
      else (r < 2 ? w0 : w1).push_finished(r);
    }
    CHECK(front.finished_ready() == 6);
    const auto progress = front.async_progress();
    CHECK(progress.size() == 3 && progress[2].second == 0);
    const uint32_t first = 1 + round % 5;
    std::vector<uint32_t> got = front.pop_finished(first);
    for (uint32_t r : front.pop_finished(6 - first)) got.push_back(r);
    CHECK(got == order);
  }
  std::printf("the caller's own ring: sent, popped and merged by ticket: ok\n");
}

void test_worker_sees_dead_parent() {
  Arena a = make_arena();
  FrontChannel front(a.base, a.fixed, true);
  int pipe_fds[2];
  pid_t pid = fork_worker0(a, pipe_fds);
  close(pipe_fds[1]);  // as if the front end died: the worker must exit on its own
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 2);
  std::printf("worker exits when the front end is gone: ok\n");
}

void test_front_sees_dead_worker() {
  Arena a = make_arena();
  FrontChannel front(a.base, a.fixed, true);
  pid_t pid = fork();
  if (pid == 0) _exit(7);  // dies without serving
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  // A sentinel that is ready, as a dead process's is.
  int dead[2];
  CHECK(pipe(dead) == 0);
  close(dead[1]);
  std::vector<int> sentinels = {dead[0], dead[0]};
  front.post({0}, 5, 0, {});
  CHECK(front.wait(sentinels, 10.0, never_interrupted) == 1);  // 1 + worker 0
  std::printf("front end notices a dead worker: ok\n");
}

void test_adaptive_spin() {
  const int64_t cap = AdaptiveSpin::kSpinCapNs;
  AdaptiveSpin spin(2'000, cap);
  const int64_t floor = AdaptiveSpin::kSleepCostNs;
  int64_t t = 1'000'000'000;  // the time of each wait, in ns
  for (int i = 0; i < 50; ++i) spin.observe(10'000);
  CHECK(spin.budget_ns(t) == floor);  // a 10 us peer: spin at least what a sleep costs
  for (int i = 0; i < 50; ++i) spin.observe(700'000);
  CHECK(spin.budget_ns(t) > 1'300'000 && spin.budget_ns(t) <= cap);  // past a 700 us peer, within the cap
  for (int i = 0; i < 50; ++i) spin.observe(5'000'000);
  CHECK(spin.budget_ns(t) == 2'000);  // a slow peer: sleep almost at once
  spin.observe(5'000'000);
  for (int i = 0; i < 30; ++i) spin.observe(1'000);
  CHECK(spin.budget_ns(t) == floor);  // a few quick answers bring spinning back
  AdaptiveSpin small_cap(2'000, 50'000);
  for (int i = 0; i < 50; ++i) small_cap.observe(10'000);
  CHECK(small_cap.budget_ns(t) == 50'000);  // the cap bounds the floor too
  for (int i = 0; i < 50; ++i) spin.observe(10'000);

  // A spin lost its core: sleep at once for a window, then try spinning again.
  const int64_t w = AdaptiveSpin::kBackoffMinNs;
  spin.preempted(t);
  CHECK(spin.budget_ns(t) == 0 && spin.budget_ns(t + w - 1) == 0);
  CHECK(spin.budget_ns(t + w) > 10'000);
  // Lost again soon after: each window twice the last, up to the cap.
  t += w + w / 2;
  spin.preempted(t);
  CHECK(spin.budget_ns(t + 2 * w - 1) == 0 && spin.budget_ns(t + 2 * w) > 10'000);
  int64_t window = 2 * w;
  for (int i = 0; i < 20; ++i) {
    t += window;
    spin.preempted(t);
    window = std::min(2 * window, AdaptiveSpin::kBackoffMaxNs);
  }
  CHECK(window == AdaptiveSpin::kBackoffMaxNs);
  CHECK(spin.budget_ns(t + window - 1) == 0 && spin.budget_ns(t + window) > 10'000);
  // A loss after a calm longer than the last window starts from the shortest again.
  t += 3 * window;
  spin.preempted(t);
  CHECK(spin.budget_ns(t + w - 1) == 0 && spin.budget_ns(t + w) > 10'000);
  std::printf("adaptive spin: ok\n");
}

void test_wake_forecast() {
  const int64_t ms = 1'000'000;
  int64_t t = 1'000'000'000;  // the time of each wait
  WakeForecast f;
  for (int i = 0; i < WakeForecast::kWindow - 1; ++i) f.observe(10 * ms);
  CHECK(f.doze_ns(t) == 0);  // too few waits to foresee the next
  f.observe(10 * ms);
  const int64_t doze = f.doze_ns(t);
  // Wakes a lead before the shortest wait ends, then spins through the lead.
  CHECK(doze >= 10 * ms - WakeForecast::kMaxLeadNs && doze <= 10 * ms - WakeForecast::kMinLeadNs);
  const int64_t lead = 10 * ms - doze;
  CHECK(f.spin_after_doze_ns() == 2 * lead);
  // A timer that fires late moves the wake-up earlier, up to the longest lead.
  for (int i = 0; i < 20; ++i) f.woke_late(5 * ms);
  CHECK(f.doze_ns(t) == 10 * ms - WakeForecast::kMaxLeadNs);
  for (int i = 0; i < 40; ++i) f.woke_late(0);
  CHECK(f.doze_ns(t) == 10 * ms - WakeForecast::kMinLeadNs);
  // Spread waits: doze to before the shortest, spin at most the spin cap.
  for (int i = 0; i < WakeForecast::kWindow; ++i) f.observe((i % 2 ? 12 : 9) * ms);
  CHECK(f.doze_ns(t) == 9 * ms - WakeForecast::kMinLeadNs);
  CHECK(f.spin_after_doze_ns() == AdaptiveSpin::kSpinCapNs);
  // One wait within the spin cap: spinning serves those, no doze.
  f.observe(AdaptiveSpin::kSpinCapNs - 1);
  CHECK(f.doze_ns(t) == 0);
  // Waits so long that a wake-up is a small share of them: no doze either.
  for (int i = 0; i < WakeForecast::kWindow; ++i) f.observe(WakeForecast::kMaxDozeNs + 1);
  CHECK(f.doze_ns(t) == 0);
  for (int i = 0; i < WakeForecast::kWindow; ++i) f.observe(10 * ms);
  CHECK(f.doze_ns(t) > 0);
  // Dozes whose spin lost its core: one alone changes nothing; two in a
  // row stop dozing for a window, doubling while losses go on, shrinking
  // after dozes that kept the core.
  const int64_t w = WakeForecast::kDozeBackoffMinNs;
  f.spun(true, t);
  CHECK(f.doze_ns(t) > 0);
  f.spun(false, t);
  f.spun(true, t);
  CHECK(f.doze_ns(t) > 0);
  f.spun(true, t);
  CHECK(f.doze_ns(t + w - 1) == 0 && f.doze_ns(t + w) > 0);
  t += w;
  f.spun(true, t);
  f.spun(true, t);
  CHECK(f.doze_ns(t + 2 * w - 1) == 0 && f.doze_ns(t + 2 * w) > 0);
  for (int i = 0; i < 80; ++i) f.spun(true, t);
  CHECK(f.doze_ns(t + WakeForecast::kDozeBackoffMaxNs - 1) == 0);
  t += WakeForecast::kDozeBackoffMaxNs;
  for (int i = 0; i < 40; ++i) f.spun(false, t);
  f.spun(true, t);
  f.spun(true, t);
  CHECK(f.doze_ns(t + w - 1) == 0 && f.doze_ns(t + w) > 0);
  std::printf("wake forecast: ok\n");
}

// A front end that posts a command 10 ms after each completion (a policy's
// gradient step between env steps): once the worker has seen a few such
// gaps, it is awake (spinning, not asleep on its futex) when most commands
// arrive, so the step does not wait for its wake-up. Before the forecast it
// slept through every such gap.
void test_worker_is_awake_for_a_foreseen_command() {
  Arena a = make_arena();
  FrontChannel front(a.base, a.fixed, true);
  int pipe_fds[2];
  pid_t pid = fork_worker0(a, pipe_fds);
  // The worker and this front end on CPUs of their own: where they share
  // one, the front end's post takes the worker's CPU, which counts as a
  // doze's lost core (rightly: spinning there only delays the poster).
  cpu_set_t all, front_cpu, worker_cpu;
  CHECK(pthread_getaffinity_np(pthread_self(), sizeof all, &all) == 0);
  if (CPU_COUNT(&all) < 2) {
    std::printf("worker awake for a foreseen command: skipped (one CPU)\n");
    kill(pid, SIGKILL);
    CHECK(waitpid(pid, nullptr, 0) == pid);
    close(pipe_fds[1]);
    return;
  }
  CPU_ZERO(&front_cpu);
  CPU_ZERO(&worker_cpu);
  for (int cpu = 0, found = 0; found < 2; ++cpu) {
    if (!CPU_ISSET(cpu, &all)) continue;
    CPU_SET(cpu, found++ == 0 ? &front_cpu : &worker_cpu);
  }
  CHECK(sched_setaffinity(pid, sizeof worker_cpu, &worker_cpu) == 0);
  CHECK(pthread_setaffinity_np(pthread_self(), sizeof front_cpu, &front_cpu) == 0);
  int never[2];
  CHECK(pipe(never) == 0);
  std::vector<int> sentinels(kWorkers, never[0]);
  const std::atomic<uint32_t>& sleeping = a.fixed.control(a.base, 0)->worker_sleeping.value;
  constexpr int kLearn = 12, kRounds = 20;
  int awake = 0;
  for (int i = 0; i < kLearn + kRounds; ++i) {
    usleep(10'000);
    if (i >= kLearn && sleeping.load() == 0) ++awake;
    front.post({0}, 10, 0, {});
    CHECK(front.wait(sentinels, 10.0, never_interrupted) == kReady);
  }
  front.post({0}, kQuit, 0, {});
  CHECK(front.wait(sentinels, 10.0, never_interrupted) == kReady);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  close(pipe_fds[1]);
  CHECK(pthread_setaffinity_np(pthread_self(), sizeof all, &all) == 0);
  std::printf("worker awake for %d of %d foreseen commands\n", awake, kRounds);
  // Not all: a timer can fire late on a busy host (its lead adapts), and
  // two lost cores in a row stop dozing for a while. Without dozing: none.
  CHECK(awake >= kRounds / 4);
}

// A spin (1 s budget) on a word that a SIGALRM handler publishes at its
// `ticks`-th call, one call a millisecond, each keeping the thread
// `steal_ns` first: time taken from the spin without a switch to another
// thread, which is what a hypervisor does to a virtual CPU. No other thread
// takes part, so none of ours can take the core.
struct SpinOutcome {
  bool preempted = false;
  int sleeps = 0;
  int64_t switches = 0;  // involuntary switches of this thread during the wait
};
std::atomic<uint32_t> alarm_word{0}, alarm_sleeping{0};
std::atomic<int> alarm_calls{0};
int alarm_ticks = 0;
int64_t alarm_steal_ns = 0;
void on_alarm(int) {
  const int64_t until = platform::now_ns() + alarm_steal_ns;
  while (platform::now_ns() < until) {
  }
  if (alarm_calls.fetch_add(1) + 1 == alarm_ticks) publish(alarm_word, 1, alarm_sleeping);
}

SpinOutcome spin_until_alarm_publishes(int ticks, int64_t steal_ns) {
  alarm_word = 0;
  alarm_calls = 0;
  alarm_ticks = ticks;
  alarm_steal_ns = steal_ns;
  struct sigaction sa {};
  sa.sa_handler = on_alarm;
  sigemptyset(&sa.sa_mask);
  CHECK(sigaction(SIGALRM, &sa, nullptr) == 0);
  itimerval every_ms{{0, 1000}, {0, 1000}}, off{};
  SpinOutcome out;
  const int64_t switches = platform::involuntary_switches();
  CHECK(setitimer(ITIMER_REAL, &every_ms, nullptr) == 0);
  const bool ok = wait_until(
      alarm_word, alarm_sleeping, [](uint32_t v) { return v != 0; }, 1'000'000'000, 10'000'000,
      [] { return true; }, [&](uint32_t) { ++out.sleeps; }, &out.preempted);
  setitimer(ITIMER_REAL, &off, nullptr);
  out.switches = platform::involuntary_switches() - switches;
  signal(SIGALRM, SIG_DFL);
  CHECK(ok);
  return out;
}

// Gaps of 200 us in a spin without a switch must not count as a lost core:
// the spin goes on and never sleeps (before the fix it slept from the first
// gap). A try in which something else did switch this thread out (another
// program, a kernel thread) proves nothing either way and is not counted.
void test_spin_survives_stolen_time() {
  int clean = 0;
  for (int attempt = 0; attempt < 50 && clean < 3; ++attempt) {
    const SpinOutcome out = spin_until_alarm_publishes(6, 200'000);
    if (out.switches != 0) continue;
    CHECK(!out.preempted);
    CHECK(out.sleeps == 0);
    ++clean;
  }
  std::printf("spin survives stolen time: ok (%d tries without a switch)\n", clean);
}

// A gap before the spin's first yield (the hypervisor taking the vCPU) without
// a switch is no lost core either: the spin goes on and never sleeps (before
// the fix it counted as one, and cheap envs' workers, whose waits mostly end
// that early, slept through most of their waits). A try in which something
// did switch this thread out is not counted.
void test_spin_survives_stolen_time_before_its_first_yield() {
  int clean = 0;
  for (int attempt = 0; attempt < 50 && clean < 3; ++attempt) {
    std::atomic<uint32_t> word{0}, sleeping{0};
    int calls = 0;
    int64_t until = 0;
    // Call 1 is wait_until's look before it spins; call 2, the spin's first
    // check, takes 200 us as a hypervisor would; from 1 ms on, it is ready.
    auto ready = [&](uint32_t) {
      const int64_t now = platform::now_ns();
      if (++calls == 1) until = now + 1'000'000;
      if (calls == 2)
        while (platform::now_ns() < now + 200'000) {
        }
      return calls > 2 && platform::now_ns() >= until;
    };
    int sleeps = 0;
    bool preempted = false;
    const int64_t switches = platform::involuntary_switches();
    const bool ok = wait_until(word, sleeping, ready, 1'000'000'000, 10'000'000, [] { return true; },
                               [&](uint32_t) { ++sleeps; }, &preempted);
    const int64_t switched = platform::involuntary_switches() - switches;
    CHECK(ok);
    if (switched != 0) continue;
    CHECK(!preempted);
    CHECK(sleeps == 0);
    ++clean;
  }
  CHECK(clean > 0);
  std::printf("spin survives stolen time before its first yield: ok (%d tries without a switch)\n", clean);
}

// Pins this thread to the first CPU it may use (threads it starts then
// share that CPU with it); returns the CPU set to restore.
cpu_set_t pin_to_one_cpu() {
  cpu_set_t all, one;
  CHECK(pthread_getaffinity_np(pthread_self(), sizeof all, &all) == 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &all)) ++cpu;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  CHECK(pthread_setaffinity_np(pthread_self(), sizeof one, &one) == 0);
  return all;
}

// A spin that shares its core with a busy thread yields to it, sees that it
// was switched out, reports the core lost and sleeps for the rest.
void test_spin_lost_to_a_thread_sleeps() {
  const cpu_set_t all = pin_to_one_cpu();
  // Started pinned (it inherits our CPU set), with SIGALRM blocked: the
  // alarm's handler runs in the spinning thread.
  sigset_t alarm, old;
  sigemptyset(&alarm);
  sigaddset(&alarm, SIGALRM);
  pthread_sigmask(SIG_BLOCK, &alarm, &old);
  std::atomic<bool> stop{false};
  std::thread hog([&] {
    while (!stop.load(std::memory_order_relaxed)) {
    }
  });
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  const SpinOutcome out = spin_until_alarm_publishes(40, 0);
  stop = true;
  hog.join();
  CHECK(pthread_setaffinity_np(pthread_self(), sizeof all, &all) == 0);
  CHECK(out.preempted);
  CHECK(out.sleeps > 0);
  std::printf("spin lost to a thread sleeps: ok\n");
}

// The same, but the busy thread is also the one we wait for: it publishes
// while it holds the core, so the spin finds the word ready as soon as it
// runs again. That is still a lost core (before the fix it went unreported:
// beside a CPU hog, each wait handed the hog the core until the next tick
// and spinning went on). A try in which the word was ready before the spin
// gave up the core (no switch during the wait) proves nothing and is not
// counted. One in which the switch came within the spin's first few
// microseconds, before its first yield, may go unreported (that gap is
// taken for the hypervisor's): one such try is allowed, at a tick's
// chance of landing there (about 3 us in 4 ms); the old miss was every try.
void test_spin_lost_to_the_peer_it_waits_for_reports_it() {
  const cpu_set_t all = pin_to_one_cpu();
  int counted = 0, missed = 0;
  for (int attempt = 0; attempt < 20 && counted < 3; ++attempt) {
    std::atomic<uint32_t> word{0}, sleeping{0};
    std::atomic<bool> go{false}, stop{false};
    std::thread peer([&] {  // inherits our CPU set
      while (!go.load(std::memory_order_relaxed)) {
      }
      const int64_t until = platform::now_ns() + 300'000;
      while (platform::now_ns() < until) {
      }
      publish(word, 1, sleeping);
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
    bool preempted = false;
    go = true;
    const int64_t switches = platform::involuntary_switches();
    const bool ok = wait_until(
        word, sleeping, [](uint32_t v) { return v != 0; }, 1'000'000'000, 10'000'000,
        [] { return true; }, &preempted);
    const int64_t switched = platform::involuntary_switches() - switches;
    stop = true;
    peer.join();
    CHECK(ok);
    if (switched == 0) continue;
    if (!preempted) {
      CHECK(++missed <= 1);
      continue;
    }
    ++counted;
  }
  CHECK(pthread_setaffinity_np(pthread_self(), sizeof all, &all) == 0);
  CHECK(counted > 0);
  std::printf("spin lost to the peer it waits for reports it: ok (%d tries)\n", counted);
}

// A SIGINT during a hold reaches the process's handler only at release (or
// at once, if it is the hold's second); handlers that are not functions
// are left alone.
std::atomic<int> g_sigints{0};
void count_sigint(int) { g_sigints.fetch_add(1); }

void test_interrupt_hold() {
  struct sigaction counting = {}, saved;
  counting.sa_handler = count_sigint;
  sigemptyset(&counting.sa_mask);
  CHECK(sigaction(SIGINT, &counting, &saved) == 0);

  platform::hold_interrupt();
  raise(SIGINT);
  CHECK(g_sigints.load() == 0);  // kept
  CHECK(platform::release_interrupt());
  CHECK(g_sigints.load() == 1);  // delivered at release

  platform::hold_interrupt();
  platform::hold_interrupt();  // nested: only the outermost release delivers
  raise(SIGINT);
  CHECK(!platform::release_interrupt());
  CHECK(g_sigints.load() == 1);
  raise(SIGINT);  // the second: through at once
  CHECK(g_sigints.load() == 2);
  raise(SIGINT);  // and so is any after it
  CHECK(g_sigints.load() == 3);
  CHECK(!platform::release_interrupt());  // nothing left to deliver
  CHECK(g_sigints.load() == 3);

  raise(SIGINT);  // no hold: at once
  CHECK(g_sigints.load() == 4);
  platform::hold_interrupt();
  CHECK(!platform::release_interrupt());  // a hold without a SIGINT delivers none
  CHECK(g_sigints.load() == 4);

  // A handler set during a hold's absence (as signal.signal() does) is
  // wrapped again at the next hold.
  CHECK(sigaction(SIGINT, &counting, nullptr) == 0);
  platform::hold_interrupt();
  raise(SIGINT);
  CHECK(g_sigints.load() == 4);
  CHECK(platform::release_interrupt());
  CHECK(g_sigints.load() == 5);

  struct sigaction ignore = {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  CHECK(sigaction(SIGINT, &ignore, nullptr) == 0);
  platform::hold_interrupt();
  struct sigaction now;
  CHECK(sigaction(SIGINT, nullptr, &now) == 0);
  CHECK(!(now.sa_flags & SA_SIGINFO) && now.sa_handler == SIG_IGN);  // not wrapped
  raise(SIGINT);
  CHECK(!platform::release_interrupt());

  CHECK(sigaction(SIGINT, &saved, nullptr) == 0);
  std::printf("SIGINT held for a hold, then delivered; a second goes through: ok\n");
}

}  // namespace

int main() {
  test_interrupt_hold();
  test_adaptive_spin();
  test_wake_forecast();
  test_worker_is_awake_for_a_foreseen_command();
  test_spin_survives_stolen_time();
  test_spin_survives_stolen_time_before_its_first_yield();
  test_spin_lost_to_a_thread_sleeps();
  test_spin_lost_to_the_peer_it_waits_for_reports_it();
  test_worker_sees_dead_parent();
  test_front_sees_dead_worker();
  test_commands_and_async();
  test_pop_finished_takes_the_oldest_across_workers();
  test_callers_own_ring_merges_with_the_workers();
  return 0;
}
