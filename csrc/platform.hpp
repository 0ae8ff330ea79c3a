// Operating-system calls used by the core. Everything Linux-specific lives in
// platform_linux.cpp so that another platform needs only one new file.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace shmvec::platform {

// An anonymous shared-memory file of `size` bytes (memfd). Returns the fd, or
// -errno on failure. It has no name, so nothing can leak in /dev/shm.
int create_shared_file(std::size_t size);
// Grows or shrinks a shared file. Returns 0 or -errno.
int resize_shared_file(int fd, std::size_t size);
// Maps `size` bytes of a shared file read-write and MAP_SHARED; nullptr on error.
void* map_shared(int fd, std::size_t size);
void unmap(void* addr, std::size_t size);

enum class WaitResult { changed, timed_out, interrupted };

// Sleeps while *word == expected, at most `timeout_ns` (futex without the
// private flag: the word is shared between processes).
WaitResult futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns);
// Wakes up to `count` sleepers on `word`.
void futex_wake(std::atomic<uint32_t>* word, int count);

// Non-blocking check of a set of fds: returns the index of the first one that
// is readable or hung up (a process sentinel or the end of a pipe), or -1.
int first_ready_fd(const int* fds, int count);

// Starts a thread that waits until `fd` (the read end of a pipe) hangs up,
// then gives the process `grace_ns` to exit on its own and ends it with
// `exit_code`: a worker outlives its dead parent by at most that much, even
// inside an env's step that never returns. Returns false if no thread started.
bool exit_when_hung_up(int fd, int64_t grace_ns, int exit_code);

// Offers the CPU to another runnable thread on this core (sched_yield).
void yield_cpu();

// The CPU this thread runs on now (sched_getcpu), or -1 if unknown.
int current_cpu();

// How many times this thread has been switched out involuntarily (preempted
// by, or yielded to, another thread of this system). Time the hypervisor
// takes from a virtual CPU does not count: the guest switched nothing.
int64_t involuntary_switches();

// Ctrl-C held while the caller steps its own envs: a KeyboardInterrupt in
// the middle of an env's step would leave that env, and the batch, half done.
// While a hold is on, the first SIGINT is kept (with a line on stderr if the
// hold had already lasted kHoldNoticeNs: an env may hang) and a second one
// is delivered at once, as an escape. release_interrupt() ends the hold and
// delivers a kept SIGINT; it returns whether it did. Holds nest and may be
// taken by several threads. Only a SIGINT handler that is a function (not
// SIG_DFL or SIG_IGN) is held: hold_interrupt() wraps the current one if a
// later signal.signal() replaced the wrapper.
constexpr int64_t kHoldNoticeNs = 500'000'000;
void hold_interrupt();
bool release_interrupt();

// Monotonic clock in nanoseconds.
int64_t now_ns();

// Tells the CPU we are in a spin loop (x86 `pause`, Arm `yield`).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace shmvec::platform
