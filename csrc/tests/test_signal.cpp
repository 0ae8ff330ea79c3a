// Native tests of the core, no Python: commands and completions between a
// front end and forked workers over a memfd arena (many round trips, so a
// lost wake-up shows up as a timeout), async rings, and the spin budget.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
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
  const std::size_t size = a.async_offset + AsyncRegion::size(kEnvs, kWorkers, 64);
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

void test_worker_sees_dead_parent() {
  Arena a = make_arena();
  FrontChannel front(a.base, a.fixed, true);
  int pipe_fds[2];
  CHECK(pipe(pipe_fds) == 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[1]);
    worker_main(a, 0, pipe_fds[0]);
  }
  close(pipe_fds[0]);
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
  AdaptiveSpin spin(2'000, 50'000);
  for (int i = 0; i < 50; ++i) spin.observe(10'000);
  CHECK(spin.budget_ns() > 10'000 && spin.budget_ns() <= 50'000);  // spins past a 10 us peer
  for (int i = 0; i < 50; ++i) spin.observe(5'000'000);
  CHECK(spin.budget_ns() == 2'000);  // a slow peer: sleep almost at once
  spin.observe(5'000'000);
  for (int i = 0; i < 30; ++i) spin.observe(1'000);
  CHECK(spin.budget_ns() < 50'000);  // a few quick answers bring spinning back
  for (int i = 0; i < 50; ++i) spin.observe(10'000);
  spin.preempted();  // a spin lost its core: sleep at once for a while
  for (int i = 0; i < AdaptiveSpin::kBackoffWaits; ++i) CHECK(spin.budget_ns() == 0);
  CHECK(spin.budget_ns() > 10'000);  // then try spinning again
  std::printf("adaptive spin: ok\n");
}

}  // namespace

int main() {
  test_adaptive_spin();
  test_worker_sees_dead_parent();
  test_front_sees_dead_worker();
  test_commands_and_async();
  return 0;
}
