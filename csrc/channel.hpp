// The control protocol between the front end and its workers, in plain C++
// (no Python): commands and completions over the fixed region of the arena,
// and the rings of async mode in the data region.
//
// Every worker has a doorbell (cmd_seq) that the front end rings for two
// reasons: a new command (whose `id` then changes), or new envs in the
// worker's todo ring (async mode; the id stays). So a kick never clobbers a
// command, and a worker never runs a command twice.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "arena.hpp"
#include "signal.hpp"

namespace shmvec {

// Async mode's shared structures, placed at an offset in the data region:
//   [AsyncHeader][per stepper: todo ring, finished ring][record slot per env]
// A stepper is a worker, or the front end for the caller's own slice (the
// last pair of rings, when it has one: it steps them in recv(), where it
// would otherwise wait). Each ring has one producer and one consumer: the
// front end queues envs to step in a stepper's todo ring, the stepper queues
// the envs it finished in its finished ring, stamped with a ticket from one
// shared counter so the front end can return them in the order they finished.
// (One multi-producer ring would need the consumer to wait for a producer that
// reserved a slot but has not filled it yet; here `finished_count` never runs
// ahead of what can be popped.) Each env is in flight at most once, so rings of capacity >=
// num_envs never overflow and nobody ever waits for space.
// The rings are the truth about what is ready; `finished_count` only wakes
// the front end. (A worker may die between its push and its count: a count
// of pops would then lag for good.)
struct alignas(kLine) AsyncHeader {
  Word finished_count;  // bumped by a worker after each push; the front end sleeps on it
  // Written by the front end only: 1 while it sleeps, and the finished_count
  // to wake it at (one wake-up per recv(), not one per finished env).
  struct alignas(kLine) {
    std::atomic<uint32_t> sleeping;
    std::atomic<uint32_t> wake_at;
  } front;
  alignas(kLine) std::atomic<uint64_t> next_ticket;
};

struct FinishedItem {
  uint64_t ticket;
  uint32_t row;
  uint32_t reserved;
};

struct alignas(kLine) Ring {
  alignas(kLine) std::atomic<uint32_t> tail;  // written by the producer only
  alignas(kLine) std::atomic<uint32_t> head;  // written by the consumer only
};

// Per env: the record of its last async step (infos, episode end, ...).
struct alignas(kLine) RecordSlot {
  int64_t length;     // bytes of the record, 0 when there is none
  int32_t is_error;   // the record is a pickled exception
  int32_t overflow;   // too large for the slot: the worker holds it until fetched
};

struct AsyncRegion {
  char* base = nullptr;
  uint32_t num_envs = 0, rings = 0, capacity = 0;  // rings: pairs of them, one per stepper
  uint64_t record_capacity = 0;

  AsyncRegion() = default;
  AsyncRegion(char* base, uint32_t num_envs, uint32_t rings, uint64_t record_capacity);
  static std::size_t size(uint32_t num_envs, uint32_t rings, uint64_t record_capacity);

  AsyncHeader* header() const { return reinterpret_cast<AsyncHeader*>(base); }
  Ring* todo(uint32_t worker) const { return reinterpret_cast<Ring*>(worker_area(worker)); }
  uint32_t* todo_items(uint32_t worker) const {
    return reinterpret_cast<uint32_t*>(worker_area(worker) + sizeof(Ring));
  }
  Ring* finished(uint32_t worker) const {
    return reinterpret_cast<Ring*>(worker_area(worker) + finished_offset());
  }
  FinishedItem* finished_items(uint32_t worker) const {
    return reinterpret_cast<FinishedItem*>(worker_area(worker) + finished_offset() + sizeof(Ring));
  }
  RecordSlot* record(uint32_t row) const {
    return reinterpret_cast<RecordSlot*>(base + records_offset() + row * record_stride());
  }
  char* record_data(uint32_t row) const { return reinterpret_cast<char*>(record(row) + 1); }

 private:
  // Inline: send() and recv() find every env's ring and record slot with them.
  char* worker_area(uint32_t w) const { return base + sizeof(AsyncHeader) + w * worker_stride(); }
  std::size_t finished_offset() const { return sizeof(Ring) + round_up(capacity * sizeof(uint32_t), kLine); }
  std::size_t worker_stride() const {
    return finished_offset() + sizeof(Ring) + round_up(capacity * sizeof(FinishedItem), kLine);
  }
  std::size_t records_offset() const { return sizeof(AsyncHeader) + rings * worker_stride(); }
  std::size_t record_stride() const { return sizeof(RecordSlot) + round_up(record_capacity, kLine); }
};

// A stepper's side of its rings: takes the next env to step from its todo
// ring, and queues an env it finished (with its ticket) in its finished ring,
// waking the front end if this is the push it sleeps for.
bool pop_todo(const AsyncRegion& region, uint32_t stepper, uint32_t* row);
void push_finished(const AsyncRegion& region, uint32_t stepper, uint32_t row);

// How a wait ended.
enum WaitStatus : int { kReady = 0, kTimedOut = -1, kInterrupted = -2 };  // > 0: 1 + dead worker

class FrontChannel {
 public:
  // Called between sleeps: true means stop waiting (a signal is pending).
  using Interrupted = std::function<bool()>;

  FrontChannel(char* base, FixedLayout layout, bool initialize);

  // Gives `code` to each of `workers` (with its request length) and rings them.
  void post(const std::vector<uint32_t>& workers, uint32_t code, uint32_t arg,
            const std::vector<uint64_t>& request_lens);
  // Waits until every posted worker has completed. Returns a WaitStatus.
  int wait(const std::vector<int>& sentinels, double timeout_s, const Interrupted& interrupted);
  bool busy() const;
  // The id of the last command posted: a caller interrupted around a post
  // tells by it whether the workers got the command.
  uint32_t posted_id() const { return last_id_; }
  // Gives up on a dead worker's part of the current command: wait() no longer
  // waits for it (nor asks its completion to wake the front end), so the
  // others still wake it. Returns whether it was still busy.
  bool abandon(uint32_t w);
  bool done(uint32_t w) const;
  // Workers given the last command that have not completed it.
  std::vector<uint32_t> busy_workers() const;
  const WorkerControl& control_of(uint32_t w) const { return *control(w); }
  std::vector<uint32_t> workers_with_replies() const;

  // Async mode. `owner_of_row` is each env's stepper: a worker, or
  // num_workers for the caller's own slice (whose todo ring it pops itself).
  void attach_async(AsyncRegion region, std::vector<uint32_t> owner_of_row);
  // Queues envs to step with their owners and rings each owning worker once.
  void send(const std::vector<uint32_t>& rows);
  // Envs queued by send() so far: a caller interrupted around a send tells
  // by it whether the envs went.
  uint64_t sent_count() const { return sent_count_; }
  // Waits until at least `count` finished envs are ready to pop.
  int wait_finished(uint32_t count, const std::vector<int>& sentinels, double timeout_s,
                    const Interrupted& interrupted);
  uint32_t finished_ready() const;
  // Pops exactly `count` finished rows (at least that many must be ready),
  // in the order they finished.
  std::vector<uint32_t> pop_finished(uint32_t count);
  // The caller's own slice (async mode): its next env to step, and one it stepped.
  bool pop_own(uint32_t* row) { return pop_todo(async_, own_ring(), row); }
  void push_own(uint32_t row) { push_finished(async_, own_ring(), row); }
  // Envs queued for the caller's own slice and not yet stepped.
  uint32_t own_pending() const;
  // Per stepper (the caller's slice last): (envs it has finished, envs sent
  // to it and not yet finished).
  std::vector<std::pair<uint32_t, uint32_t>> async_progress() const;
  // 1 + the first worker whose sentinel says it died, else 0 (no waiting).
  int first_dead(const std::vector<int>& sentinels) const { return dead_worker(sentinels, false); }
  // Empties a dead worker's rings before its replacement starts (the only
  // time the front end writes a worker's indices: nobody else is there).
  void reset_async_worker(uint32_t w);
  const AsyncRegion& async_region() const { return async_; }

 private:
  ArenaHeader* header() const { return layout_.header(base_); }
  WorkerControl* control(uint32_t w) const { return layout_.control(base_, w); }
  void ring(uint32_t w);
  uint32_t own_ring() const;  // the caller's slice's rings (async mode), checked
  bool all_done() const;
  uint32_t busy_count() const;  // posted workers that have not completed
  // 1 + the first worker whose sentinel says it died, else 0; with
  // `only_busy`, only posted workers that have not completed count.
  int dead_worker(const std::vector<int>& sentinels, bool only_busy) const;
  // Between the sleeps of a wait: false (stop) with `status` set when the wait
  // is interrupted, a worker died or the deadline passed.
  bool keep_waiting(const Interrupted& interrupted, const std::vector<int>& sentinels, bool only_busy,
                    int64_t deadline, int& status) const;

  char* base_;
  FixedLayout layout_;
  AdaptiveSpin spin_;
  std::vector<uint32_t> seq_;    // doorbell value last rung for each worker
  std::vector<uint8_t> posted_;  // workers given the last command
  uint32_t last_id_ = 0;         // id of the last command posted
  uint64_t sent_count_ = 0;      // envs queued by send()
  AsyncRegion async_;
  std::vector<uint32_t> owner_;  // worker of each env row
};

class WorkerChannel {
 public:
  WorkerChannel(char* base, FixedLayout layout, uint32_t worker, int parent_fd);

  // Sleeps until the doorbell rings; false when the front end is gone.
  // Check take_command() (and the todo ring) before sleeping: the front end
  // may have rung before this worker started.
  bool wait_doorbell();
  // True once per new command (a ring may only mean new async work).
  bool take_command();
  const WorkerControl& control_of() const { return *control(); }
  // Completes the current command; wakes the front end if it sleeps and this
  // is the completion it waits for.
  void complete(int32_t status, uint64_t reply_len, uint64_t reply_total);

  // Async mode.
  void attach_async(AsyncRegion region) { async_ = region; }
  bool has_async() const { return async_.base != nullptr; }
  bool pop_todo(uint32_t* row);
  void push_finished(uint32_t row);
  const AsyncRegion& async_region() const { return async_; }

 private:
  WorkerControl* control() const { return layout_.control(base_, worker_); }

  char* base_;
  FixedLayout layout_;
  uint32_t worker_;
  int parent_fd_;
  AdaptiveSpin spin_;
  WakeForecast forecast_;
  uint32_t seen_;        // doorbell value last seen
  uint32_t handled_id_;  // id of the last command taken
  uint32_t current_id_;  // id of the command being served (stamped on completion)
  AsyncRegion async_;
};

}  // namespace shmvec
