#include "platform.hpp"

#include <cerrno>
#include <ctime>
#include <climits>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <system_error>
#include <thread>

namespace shmvec::platform {

int create_shared_file(std::size_t size) {
  int fd = static_cast<int>(syscall(SYS_memfd_create, "shmvec-arena", MFD_CLOEXEC));
  if (fd < 0) return -errno;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    return -err;
  }
  return fd;
}

int resize_shared_file(int fd, std::size_t size) {
  return ftruncate(fd, static_cast<off_t>(size)) == 0 ? 0 : -errno;
}

void* map_shared(int fd, std::size_t size) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void unmap(void* addr, std::size_t size) {
  if (addr) munmap(addr, size);
}

WaitResult futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
  // FUTEX_WAIT, not FUTEX_WAIT_PRIVATE: the word is in a MAP_SHARED mapping
  // watched by other processes.
  long rc = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts,
                    nullptr, 0);
  if (rc == 0) return WaitResult::changed;
  if (errno == ETIMEDOUT) return WaitResult::timed_out;
  if (errno == EINTR) return WaitResult::interrupted;
  return WaitResult::changed;  // EAGAIN: the word had already changed
}

void futex_wake(std::atomic<uint32_t>* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr, 0);
}

int first_ready_fd(const int* fds, int count) {
  constexpr int kMax = 256;
  struct pollfd p[kMax];
  int n = count < kMax ? count : kMax;
  for (int i = 0; i < n; ++i) {
    p[i].fd = fds[i];
    p[i].events = POLLIN;
    p[i].revents = 0;
  }
  if (poll(p, static_cast<nfds_t>(n), 0) <= 0) return -1;
  for (int i = 0; i < n; ++i)
    if (p[i].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) return i;
  return -1;
}

bool exit_when_hung_up(int fd, int64_t grace_ns, int exit_code) {
  try {
    std::thread([fd, grace_ns, exit_code] {
      struct pollfd p = {fd, POLLIN, 0};
      while (poll(&p, 1, -1) < 0)
        if (errno != EINTR) return;  // (a bad fd: no guard, as before)
      const struct timespec grace = {static_cast<time_t>(grace_ns / 1'000'000'000),
                                     static_cast<long>(grace_ns % 1'000'000'000)};
      nanosleep(&grace, nullptr);
      _exit(exit_code);
    }).detach();
  } catch (const std::system_error&) {
    return false;
  }
  return true;
}

void yield_cpu() { sched_yield(); }

int current_cpu() { return sched_getcpu(); }

int64_t involuntary_switches() {
  struct rusage usage;
  if (getrusage(RUSAGE_THREAD, &usage) != 0) return -1;
  return usage.ru_nivcsw;
}

int64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// -- Ctrl-C held while the caller steps its own envs ----------------------------

namespace {

std::atomic<int> g_holds{0};
// 0: no SIGINT since the hold began; 1: one came and is kept for release;
// 2: a second came, so every SIGINT goes through until the hold ends.
std::atomic<int> g_kept{0};
std::atomic<int64_t> g_hold_since{0};
// The handler ours stands in front of (Python's). Written only while ours is
// not installed.
struct sigaction g_wrapped;

void on_sigint(int sig, siginfo_t* info, void* context) {
  if (g_holds.load() > 0) {
    int none = 0;
    if (g_kept.compare_exchange_strong(none, 1)) {
      if (now_ns() - g_hold_since.load() >= kHoldNoticeNs) {
        static const char notice[] =
            "\nshmvec: Ctrl-C: the envs this process steps itself finish their step first; "
            "press Ctrl-C again to stop them now (their batch is then half done)\n";
        ssize_t written = write(STDERR_FILENO, notice, sizeof notice - 1);
        (void)written;  // nothing to do about a closed stderr in a signal handler
      }
      return;
    }
    g_kept.store(2);
  }
  if (g_wrapped.sa_flags & SA_SIGINFO)
    g_wrapped.sa_sigaction(sig, info, context);
  else
    g_wrapped.sa_handler(sig);
}

// Puts on_sigint in front of SIGINT's handler, unless it is there already or
// the handler is SIG_DFL or SIG_IGN (nothing to hold).
void wrap_sigint() {
  struct sigaction current;
  if (sigaction(SIGINT, nullptr, &current) != 0) return;
  if (current.sa_flags & SA_SIGINFO) {
    if (current.sa_sigaction == on_sigint) return;
  } else if (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN) {
    return;
  }
  g_wrapped = current;
  struct sigaction ours = current;
  ours.sa_flags |= SA_SIGINFO;
  ours.sa_sigaction = on_sigint;
  sigaction(SIGINT, &ours, nullptr);
}

}  // namespace

void hold_interrupt() {
  if (g_holds.fetch_add(1) == 0) {
    g_hold_since.store(now_ns());
    // Checked at every hold, not once: signal.signal() installs Python's
    // handler again, in place of ours.
    wrap_sigint();
  }
}

bool release_interrupt() {
  if (g_holds.fetch_sub(1) != 1) return false;  // an outer hold goes on
  if (g_kept.exchange(0) != 1) return false;
  raise(SIGINT);  // through whatever handler is installed now
  return true;
}

}  // namespace shmvec::platform
