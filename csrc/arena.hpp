// Layout of the fixed part of the shared arena: a header, one control block
// per worker, and per-worker byte areas for requests and replies. The data
// region (actions, observations, rewards, flags) follows; its layout is
// computed from the spaces in shmvec/layout.py.
//
//   [ArenaHeader][WorkerControl x W][request area x W][reply area x W] | data
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace shmvec {

// Two cache lines: adjacent-line prefetch makes 64 bytes too little to keep
// words written by different processes from sharing a line.
constexpr std::size_t kLine = 128;
constexpr uint64_t kMagic = 0x63657676686d73ULL;  // "shmvvec"
constexpr uint32_t kVersion = 2;

// A 32-bit futex word alone on its line.
struct alignas(kLine) Word {
  std::atomic<uint32_t> value{0};
};
static_assert(sizeof(Word) == kLine);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<int64_t>::is_always_lock_free);

struct alignas(kLine) ArenaHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_workers;
  uint64_t request_capacity;
  uint64_t reply_capacity;
  // Completions of commands, counted by each worker after it publishes
  // done_id. Never reset: a late count from an earlier command is one more,
  // never one taken away from a later command. The front end sleeps on it.
  Word completions;
  // Written by the front end only, before it sleeps on `completions`.
  struct alignas(kLine) {
    std::atomic<uint32_t> sleeping;  // 1 while it sleeps
    std::atomic<uint32_t> wake_at;   // the count of completions to wake it at
  } front;
};

struct alignas(kLine) WorkerControl {
  Word cmd_seq;          // written by the front end only: the doorbell (a command or async work)
  Word worker_sleeping;  // written by the worker only: 1 while it sleeps on cmd_seq
  Word done_id;          // written by the worker only: id of the command it last completed
  // The command; plain fields, published by the release store of `id`.
  struct alignas(kLine) {
    uint32_t code;
    uint32_t arg;
    uint64_t request_len;
    // When it was posted: lets the worker learn the front end's pace. Atomic:
    // a worker woken by a ring for async work reads it while the front end
    // may be posting the next command.
    std::atomic<int64_t> posted_ns;
    // Changes with every command (the doorbell also rings for async work).
    // Stored last, with release: a worker that acquires a new id sees the
    // fields above as the front end wrote them.
    std::atomic<uint32_t> id;
  } command;
  // The result; plain fields, published by the release store of done_id.
  struct alignas(kLine) {
    int32_t status;
    uint32_t reserved;
    uint64_t reply_len;    // bytes of this chunk in the reply area
    uint64_t reply_total;  // bytes of the whole reply (more chunks follow if larger)
    int64_t done_ns;       // when it finished: lets the front end learn the worker's pace
  } result;
};

inline std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

struct FixedLayout {
  uint32_t num_workers;
  uint64_t request_capacity;
  uint64_t reply_capacity;

  std::size_t controls_offset() const { return sizeof(ArenaHeader); }
  std::size_t requests_offset() const {
    return controls_offset() + num_workers * sizeof(WorkerControl);
  }
  std::size_t replies_offset() const {
    return requests_offset() + num_workers * round_up(request_capacity, kLine);
  }
  // Where the data region starts: page aligned.
  std::size_t size() const {
    return round_up(replies_offset() + num_workers * round_up(reply_capacity, kLine), 4096);
  }

  ArenaHeader* header(char* base) const { return reinterpret_cast<ArenaHeader*>(base); }
  WorkerControl* control(char* base, uint32_t w) const {
    return reinterpret_cast<WorkerControl*>(base + controls_offset()) + w;
  }
  char* request_area(char* base, uint32_t w) const {
    return base + requests_offset() + w * round_up(request_capacity, kLine);
  }
  char* reply_area(char* base, uint32_t w) const {
    return base + replies_offset() + w * round_up(reply_capacity, kLine);
  }
};

}  // namespace shmvec
