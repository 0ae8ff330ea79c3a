// Native tests of the protocol with the front end and the workers as threads
// of one process over one arena (a heap buffer instead of a memfd).
// ThreadSanitizer sees only one process, so this is where it checks every
// access to the shared words and areas: commands and completions, request and
// reply areas in chunked transfers, async rings and record slots. Randomized
// delays shake the interleavings.
//
// Built with the test hooks (csrc/test_hooks.hpp): the front end's sleep
// slice is stretched to 2 s, so a lost wake-up costs 2 s and any wait that
// long fails the test; a worker may pause between publishing a completion and
// counting it, where a lost wake-up used to hide.
//
// Usage: test_threads [rounds [test]]   (rounds of the stress test, default
// 20000; test: abandon, wakeup or stress to run only that one)
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

#include "arena.hpp"
#include "channel.hpp"
#include "platform.hpp"
#include "test_hooks.hpp"

using namespace shmvec;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);  \
      std::fflush(nullptr);                                                          \
      _exit(1);                                                                      \
    }                                                                                \
  } while (0)

namespace {

constexpr int64_t kSliceNs = 2'000'000'000;     // the front end's sleep slice in these tests
constexpr int64_t kLostWakeNs = 1'000'000'000;  // a wait this long: nobody woke the front end
constexpr uint64_t kRequestCap = 1024, kReplyCap = 1024, kRecordCap = 200;

enum Code : uint32_t { kEcho = 1, kBigReply = 2, kRequestChunk = 3, kReplyChunk = 4, kQuit = 99 };

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ULL | 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(next() % n); }
};

void sleep_us(uint32_t us) {
  struct timespec ts = {0, static_cast<long>(us) * 1000};
  nanosleep(&ts, nullptr);
}

// A randomized pause: mostly none; sometimes a spin, a yield or a short sleep.
void jitter(Rng& rng, uint32_t max_us) {
  switch (rng.below(8)) {
    case 0: {
      const int64_t end = platform::now_ns() + int64_t{rng.below(max_us + 1)} * 1000;
      while (platform::now_ns() < end) platform::cpu_relax();
      break;
    }
    case 1: platform::yield_cpu(); break;
    case 2: sleep_us(rng.below(max_us + 1)); break;
    default: break;
  }
}

// Bytes of a payload: a function of its seed and the offset in the payload.
char pattern(uint64_t seed, uint64_t i) { return static_cast<char>((seed * 131 + i * 7 + (i >> 8)) & 0xFF); }
void fill(char* p, uint64_t offset, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; ++i) p[i] = pattern(seed, offset + i);
}
bool matches(const char* p, uint64_t offset, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n; ++i)
    if (p[i] != pattern(seed, offset + i)) return false;
  return true;
}

// Delays in the gap between a worker's publish and its count (the hook).
thread_local Rng hook_rng(12345);
std::atomic<uint32_t> hook_percent{0};  // how often, in percent
void pause_between_publish_and_count(uint32_t) {
  if (hook_rng.below(100) < hook_percent.load(std::memory_order_relaxed))
    sleep_us(50 + hook_rng.below(400));
}

struct Arena {
  uint32_t workers, envs;
  FixedLayout fixed;
  std::size_t async_offset, data_offset, size;
  char* base;

  Arena(uint32_t w, uint32_t e) : workers(w), envs(e), fixed{w, kRequestCap, kReplyCap} {
    async_offset = fixed.size();
    data_offset = round_up(async_offset + AsyncRegion::size(e, w, kRecordCap), kLine);
    size = round_up(data_offset + 2 * e * sizeof(uint64_t), 4096);  // per env: action, observation
    base = static_cast<char*>(std::aligned_alloc(4096, size));
    std::memset(base, 0, size);
  }
  ~Arena() { std::free(base); }
  Arena(const Arena&) = delete;
  AsyncRegion async() const { return AsyncRegion(base + async_offset, envs, workers, kRecordCap); }
  uint64_t* actions() const { return reinterpret_cast<uint64_t*>(base + data_offset); }
  uint64_t* observations() const { return actions() + envs; }
};

// One async step: the observation and the record are functions of the action.
void step_row(const Arena& a, const AsyncRegion& region, uint32_t row) {
  const uint64_t action = a.actions()[row];
  a.observations()[row] = action * 3 + 1;
  RecordSlot* slot = region.record(row);
  slot->length = static_cast<int64_t>(action % (kRecordCap + 1));
  slot->is_error = 0;
  slot->overflow = 0;
  fill(region.record_data(row), 0, action % (kRecordCap + 1), action);
}

struct WorkerOptions {
  bool async = false;
  uint32_t work_us = 0;  // how long each command takes at least
  uint32_t jitter_us = 100;
};

// A worker thread: serves commands like the real worker (async envs first,
// then a command, else sleep on the doorbell).
void worker_main(const Arena& a, uint32_t w, int parent_fd, uint64_t seed, WorkerOptions opt) {
  Rng rng(seed);
  WorkerChannel ch(a.base, a.fixed, w, parent_fd);
  AsyncRegion region = a.async();
  if (opt.async) ch.attach_async(region);
  const char* request = a.fixed.request_area(a.base, w);
  char* reply = a.fixed.reply_area(a.base, w);
  std::vector<char> chunks;  // earlier pieces of a chunked request
  for (;;) {
    uint32_t row;
    while (ch.has_async() && ch.pop_todo(&row)) {
      jitter(rng, opt.jitter_us / 4);
      step_row(a, region, row);
      ch.push_finished(row);
    }
    if (!ch.take_command()) {
      if (!ch.wait_doorbell()) return;
      continue;
    }
    const auto& c = ch.control_of().command;
    const uint32_t code = c.code, arg = c.arg;
    const uint64_t len = c.request_len;
    jitter(rng, opt.jitter_us);
    if (opt.work_us) sleep_us(opt.work_us + rng.below(opt.work_us * 3));
    if (code == kRequestChunk) {
      chunks.insert(chunks.end(), request, request + len);
      ch.complete(0, 0, 0);
    } else if (code == kEcho) {
      // The request is every chunk so far, then this; status = its length if intact.
      std::vector<char> whole(chunks);
      chunks.clear();
      whole.insert(whole.end(), request, request + len);
      const bool ok = matches(whole.data(), 0, whole.size(), arg);
      const uint64_t n = arg % (kReplyCap + 1);
      fill(reply, 0, n, arg + 1);
      ch.complete(ok ? static_cast<int32_t>(whole.size()) : -1, n, n);
    } else if (code == kBigReply) {
      // A reply of `arg` bytes, more than the area holds: one chunk per kReplyChunk.
      const uint64_t total = arg;
      uint64_t sent = std::min<uint64_t>(total, kReplyCap);
      fill(reply, 0, sent, total);
      ch.complete(0, sent, total);
      while (sent < total) {
        while (!ch.take_command())
          if (!ch.wait_doorbell()) return;
        CHECK(ch.control_of().command.code == kReplyChunk);
        jitter(rng, opt.jitter_us);
        const uint64_t n = std::min<uint64_t>(total - sent, kReplyCap);
        fill(reply, sent, n, total);
        sent += n;
        ch.complete(0, n, total);
      }
    } else {
      CHECK(code == kQuit);
      ch.complete(0, 0, 0);
      return;
    }
  }
}

bool never_interrupted() { return false; }

struct Front {
  const Arena& a;
  FrontChannel ch;
  std::vector<int> sentinels;
  int64_t longest_ns = 0;

  Front(const Arena& arena, const std::vector<int>& s) : a(arena), ch(arena.base, arena.fixed, true), sentinels(s) {}

  void wait() {
    const int64_t start = platform::now_ns();
    const int status = ch.wait(sentinels, 30.0, never_interrupted);
    note(start, "wait");
    CHECK(status == kReady);
  }
  void wait_finished(uint32_t count) {
    const int64_t start = platform::now_ns();
    const int status = ch.wait_finished(count, sentinels, 30.0, never_interrupted);
    note(start, "wait_finished");
    CHECK(status == kReady);
  }
  void note(int64_t start, const char* what) {
    const int64_t took = platform::now_ns() - start;
    longest_ns = std::max(longest_ns, took);
    if (took >= kLostWakeNs) {
      std::fprintf(stderr, "%s took %.3f s: a lost wake-up (the front end slept out its slice)\n", what,
                   static_cast<double>(took) * 1e-9);
      std::fflush(nullptr);
      _exit(1);
    }
  }

  // Echo to `workers`, each with a request of its own length (seed `arg`).
  void echo(const std::vector<uint32_t>& workers, uint32_t arg, const std::vector<uint64_t>& lens) {
    for (size_t i = 0; i < workers.size(); ++i) fill(a.fixed.request_area(a.base, workers[i]), 0, lens[i], arg);
    ch.post(workers, kEcho, arg, lens);
    wait();
    for (size_t i = 0; i < workers.size(); ++i) check_echo(workers[i], arg, lens[i]);
  }
  void check_echo(uint32_t w, uint32_t arg, uint64_t request_len) {
    const auto& r = ch.control_of(w).result;
    const uint64_t n = arg % (kReplyCap + 1);
    CHECK(r.status == static_cast<int32_t>(request_len));
    CHECK(r.reply_len == n && r.reply_total == n);
    CHECK(matches(a.fixed.reply_area(a.base, w), 0, n, arg + 1));
  }
  // A request of `total` bytes to one worker: full chunks ahead, then the rest.
  void chunked_echo(uint32_t w, uint32_t arg, uint64_t total) {
    char* area = a.fixed.request_area(a.base, w);
    uint64_t sent = 0;
    while (total - sent > kRequestCap) {
      fill(area, sent, kRequestCap, arg);
      ch.post({w}, kRequestChunk, arg, {kRequestCap});
      wait();
      sent += kRequestCap;
    }
    fill(area, sent, total - sent, arg);
    ch.post({w}, kEcho, arg, {total - sent});
    wait();
    check_echo(w, arg, total);
  }
  // A reply of `total` bytes from one worker, fetched in chunks.
  void big_reply(uint32_t w, uint32_t total) {
    ch.post({w}, kBigReply, total, {});
    wait();
    uint64_t got = 0;
    for (;;) {
      const auto& r = ch.control_of(w).result;
      CHECK(r.status == 0 && r.reply_total == total && r.reply_len <= kReplyCap);
      CHECK(matches(a.fixed.reply_area(a.base, w), got, r.reply_len, total));
      got += r.reply_len;
      if (got == total) break;
      ch.post({w}, kReplyChunk, 0, {});
      wait();
    }
  }
  void check_async(uint32_t row) {
    const uint64_t action = a.actions()[row];
    CHECK(a.observations()[row] == action * 3 + 1);
    const AsyncRegion& region = ch.async_region();
    CHECK(region.record(row)->length == static_cast<int64_t>(action % (kRecordCap + 1)));
    CHECK(matches(region.record_data(row), 0, action % (kRecordCap + 1), action));
  }
};

struct Threads {
  int parent[2];
  int never[2];
  std::vector<std::thread> threads;
  Threads() {
    CHECK(pipe(parent) == 0);
    CHECK(pipe(never) == 0);  // an fd that never gets ready: no worker thread dies
  }
  ~Threads() {
    for (auto& t : threads) t.join();
    close(parent[0]);
    close(parent[1]);
    close(never[0]);
    close(never[1]);
  }
};

std::vector<uint32_t> all_workers(uint32_t n) {
  std::vector<uint32_t> out(n);
  for (uint32_t w = 0; w < n; ++w) out[w] = w;
  return out;
}

void quit(Front& front, uint32_t workers) {
  front.ch.post(all_workers(workers), kQuit, 0, {});
  front.wait();
}

// Everything at once, many times: commands to random sets of workers,
// requests and replies of every size up to several areas, async batches with
// a command posted while they are in flight, random delays everywhere.
void test_stress(uint32_t workers, uint32_t envs, uint32_t rounds, uint64_t seed) {
  const int64_t start = platform::now_ns();
  Arena a(workers, envs);
  Threads t;
  Front front(a, std::vector<int>(workers, t.never[0]));
  std::vector<uint32_t> owner(envs);
  for (uint32_t row = 0; row < envs; ++row) owner[row] = row * workers / envs;
  front.ch.attach_async(a.async(), owner);
  test_hooks::front_slice_ns = kSliceNs;
  hook_percent = 20;
  WorkerOptions opt;
  opt.async = true;
  for (uint32_t w = 0; w < workers; ++w)
    t.threads.emplace_back(worker_main, std::cref(a), w, t.parent[0], seed * 100 + w, opt);

  Rng rng(seed);
  const auto random_len = [&rng](uint64_t cap) -> uint64_t {
    const uint32_t k = rng.below(4);
    return k == 0 ? 0 : k == 1 ? cap : rng.below(static_cast<uint32_t>(cap) + 1);
  };
  for (uint32_t i = 0; i < rounds; ++i) {
    const uint32_t arg = static_cast<uint32_t>(rng.next());
    switch (rng.below(5)) {
      case 0:
      case 1: {  // an echo to a random non-empty set of workers
        std::vector<uint32_t> ws;
        std::vector<uint64_t> lens;
        for (uint32_t w = 0; w < workers; ++w)
          if (rng.below(3) != 0) ws.push_back(w), lens.push_back(random_len(kRequestCap));
        if (ws.empty()) ws.push_back(rng.below(workers)), lens.push_back(random_len(kRequestCap));
        front.echo(ws, arg, lens);
        break;
      }
      case 2:  // a request of up to four areas, in chunks
        front.chunked_echo(rng.below(workers), arg, random_len(4 * kRequestCap));
        break;
      case 3:  // a reply of up to four areas, in chunks
        front.big_reply(rng.below(workers), kReplyCap + 1 + rng.below(3 * kReplyCap));
        break;
      case 4: {  // an async batch, maybe with a command while it is in flight
        std::vector<uint32_t> rows;
        for (uint32_t row = 0; row < envs; ++row)
          if (rng.below(2)) rows.push_back(row), a.actions()[row] = rng.next() & 0xFFFFFF;
        const size_t half = rows.size() / 2;
        front.ch.send(std::vector<uint32_t>(rows.begin(), rows.begin() + half));
        jitter(rng, 50);
        front.ch.send(std::vector<uint32_t>(rows.begin() + half, rows.end()));
        const bool command = rng.below(2);
        const uint32_t w = rng.below(workers);
        const uint64_t len = random_len(kRequestCap);
        if (command) {
          fill(a.fixed.request_area(a.base, w), 0, len, arg);
          front.ch.post({w}, kEcho, arg, {len});
        }
        uint32_t left = static_cast<uint32_t>(rows.size());
        while (left) {
          const uint32_t take = 1 + rng.below(left);
          front.wait_finished(take);
          for (uint32_t row : front.ch.pop_finished(take)) front.check_async(row);
          left -= take;
        }
        CHECK(front.ch.finished_ready() == 0);
        if (command) {
          front.wait();
          front.check_echo(w, arg, len);
        }
        break;
      }
    }
  }
  quit(front, workers);
  std::printf("stress, %u workers, %u envs: %u rounds ok in %.2f s (longest wait %.1f ms)\n", workers, envs,
              rounds, static_cast<double>(platform::now_ns() - start) * 1e-9,
              static_cast<double>(front.longest_ns) * 1e-6);
}

// Workers slow enough that the front end sleeps on most commands, and often
// late to count a completion they already published. Sometimes the front end
// is busy after posting (as when the caller steps its own slice), so it finds
// every completion published on entry and returns at once, while a late count
// is still to come: that count then lands while the front end waits for the
// next command. No wait may sleep out a slice.
void test_no_lost_wakeup(uint32_t workers, uint32_t rounds) {
  const int64_t start = platform::now_ns();
  Arena a(workers, workers);
  Threads t;
  Front front(a, std::vector<int>(workers, t.never[0]));
  test_hooks::front_slice_ns = kSliceNs;
  hook_percent = 50;
  WorkerOptions opt;
  opt.work_us = 100;
  opt.jitter_us = 0;
  for (uint32_t w = 0; w < workers; ++w)
    t.threads.emplace_back(worker_main, std::cref(a), w, t.parent[0], 7 + w, opt);
  Rng rng(99);
  for (uint32_t i = 0; i < rounds; ++i) {
    std::vector<uint32_t> ws = all_workers(workers);
    if (rng.below(4) == 0) ws = {rng.below(workers)};
    for (uint32_t w : ws) fill(a.fixed.request_area(a.base, w), 0, 8, i);
    front.ch.post(ws, kEcho, i, std::vector<uint64_t>(ws.size(), 8));
    if (rng.below(2)) sleep_us(rng.below(1200));  // the caller's own slice
    front.wait();
    for (uint32_t w : ws) front.check_echo(w, i, 8);
  }
  quit(front, workers);
  std::printf("no lost wake-up, %u workers: %u commands ok in %.2f s (longest wait %.1f ms)\n", workers,
              rounds, static_cast<double>(platform::now_ns() - start) * 1e-9,
              static_cast<double>(front.longest_ns) * 1e-6);
}

// A worker dies mid-command; the front end abandons it and waits for the
// others, which must still wake it (the restart path of the engine).
void test_abandon_still_wakes() {
  std::atomic<bool> go{false};
  Arena a(2, 2);
  Threads t;
  int dead[2];
  CHECK(pipe(dead) == 0);
  close(dead[1]);  // ready at once, as a dead process's sentinel is
  Front front(a, {t.never[0], dead[0]});
  // Worker 0 finishes only once the front end has abandoned worker 1; worker 1 never runs.
  t.threads.emplace_back([&a, &go, fd = t.parent[0]] {
    WorkerChannel ch(a.base, a.fixed, 0, fd);
    for (int done = 0; done < 2;) {
      if (!ch.take_command()) {
        if (!ch.wait_doorbell()) return;
        continue;
      }
      while (!go.load()) sleep_us(100);
      sleep_us(3000);
      ch.complete(0, 0, 0);
      ++done;
    }
  });
  hook_percent = 0;
  test_hooks::front_slice_ns = 20'000'000;
  front.ch.post({0, 1}, kEcho, 0, {});
  CHECK(front.ch.wait(front.sentinels, 30.0, never_interrupted) == 2);  // 1 + worker 1
  CHECK(front.ch.abandon(1));
  test_hooks::front_slice_ns = kSliceNs;
  go = true;
  front.wait();  // fails the test if it sleeps out the slice
  front.ch.post({0}, kQuit, 0, {});
  front.wait();
  close(dead[0]);
  std::printf("abandoning a dead worker: the others still wake the front end (%.1f ms): ok\n",
              static_cast<double>(front.longest_ns) * 1e-6);
}

}  // namespace

int main(int argc, char** argv) {
  test_hooks::between_publish_and_count = pause_between_publish_and_count;
  const uint32_t rounds = argc > 1 ? static_cast<uint32_t>(std::atoi(argv[1])) : 20000;
  const char* only = argc > 2 ? argv[2] : nullptr;
  const auto wanted = [only](const char* name) { return !only || std::strcmp(only, name) == 0; };
  if (wanted("abandon")) test_abandon_still_wakes();
  if (wanted("wakeup")) {
    test_no_lost_wakeup(2, std::max<uint32_t>(rounds / 10, 50));
    test_no_lost_wakeup(3, std::max<uint32_t>(rounds / 10, 50));
  }
  if (wanted("stress")) {
    test_stress(2, 6, rounds, 1);
    test_stress(3, 7, rounds, 2);
  }
  std::printf("thread tests: ok\n");
  return 0;
}
