#include "channel.hpp"

#include <algorithm>
#include <climits>
#include <stdexcept>

#include "platform.hpp"
#include "test_hooks.hpp"

namespace shmvec {

namespace {
constexpr int64_t kFrontSliceNs = 20'000'000;    // the front end checks workers and signals every 20 ms
constexpr int64_t kWorkerSliceNs = 100'000'000;  // a worker checks its parent every 100 ms

uint32_t pow2_at_least(uint32_t n) {
  uint32_t c = 1;
  while (c < n) c <<= 1;
  return c;
}

int64_t deadline_after(int64_t start, double timeout_s) {
  // Negative: no timeout. Beyond ~292 years the nanoseconds would overflow.
  if (timeout_s < 0 || timeout_s > 9e9) return INT64_MAX;
  return start + static_cast<int64_t>(timeout_s * 1e9);
}
}  // namespace

// ---------------------------------------------------------------- AsyncRegion

AsyncRegion::AsyncRegion(char* b, uint32_t envs, uint32_t ring_pairs, uint64_t record_cap)
    : base(b), num_envs(envs), rings(ring_pairs), capacity(pow2_at_least(envs)),
      record_capacity(record_cap) {}

std::size_t AsyncRegion::size(uint32_t envs, uint32_t ring_pairs, uint64_t record_cap) {
  AsyncRegion r(nullptr, envs, ring_pairs, record_cap);
  return r.records_offset() + envs * r.record_stride();
}

// --------------------------------------------------------------- FrontChannel

FrontChannel::FrontChannel(char* base, FixedLayout layout, bool initialize)
    : base_(base), layout_(layout), spin_(2'000, AdaptiveSpin::kSpinCapNs), seq_(layout.num_workers, 0),
      posted_(layout.num_workers, 0) {
  ArenaHeader* h = header();
  if (initialize) {
    h->magic = kMagic;
    h->version = kVersion;
    h->num_workers = layout.num_workers;
    h->request_capacity = layout.request_capacity;
    h->reply_capacity = layout.reply_capacity;
  } else if (h->magic != kMagic || h->version != kVersion || h->num_workers != layout.num_workers) {
    throw std::invalid_argument("arena header does not match");
  }
  for (uint32_t w = 0; w < layout.num_workers; ++w) {
    seq_[w] = control(w)->cmd_seq.value.load(std::memory_order_relaxed);
    last_id_ = std::max(last_id_, control(w)->command.id.load(std::memory_order_relaxed));
  }
}

void FrontChannel::ring(uint32_t w) {
  WorkerControl* c = control(w);
  publish(c->cmd_seq.value, ++seq_[w], c->worker_sleeping.value);
}

void FrontChannel::post(const std::vector<uint32_t>& workers, uint32_t code, uint32_t arg,
                        const std::vector<uint64_t>& request_lens) {
  if (!request_lens.empty() && request_lens.size() != workers.size())
    throw std::invalid_argument("one request length per worker");
  if (busy()) throw std::logic_error("post() while workers are still busy with a command");
  for (uint32_t w : workers)
    if (w >= seq_.size()) throw std::out_of_range("worker index out of range");
  std::fill(posted_.begin(), posted_.end(), 0);
  const int64_t now = platform::now_ns();
  const uint32_t id = ++last_id_;
  for (size_t i = 0; i < workers.size(); ++i) {
    WorkerControl* c = control(workers[i]);
    posted_[workers[i]] = 1;
    c->command.code = code;
    c->command.arg = arg;
    c->command.request_len = request_lens.empty() ? 0 : request_lens[i];
    // Relaxed: only a hint for the worker's spin budget (see wait_doorbell).
    c->command.posted_ns.store(now, std::memory_order_relaxed);
    c->command.id.store(id, std::memory_order_release);
    ring(workers[i]);
  }
}

bool FrontChannel::done(uint32_t w) const {
  // Acquire pairs with the worker's release of done_id: its result is visible.
  return control(w)->done_id.value.load(std::memory_order_acquire) == last_id_;
}

bool FrontChannel::all_done() const { return busy_count() == 0; }

uint32_t FrontChannel::busy_count() const {
  uint32_t n = 0;
  for (uint32_t w = 0; w < seq_.size(); ++w)
    if (posted_[w] && !done(w)) ++n;
  return n;
}

std::vector<uint32_t> FrontChannel::busy_workers() const {
  std::vector<uint32_t> out;
  for (uint32_t w = 0; w < seq_.size(); ++w)
    if (posted_[w] && !done(w)) out.push_back(w);
  return out;
}

bool FrontChannel::abandon(uint32_t w) {
  if (w >= seq_.size()) throw std::out_of_range("worker index out of range");
  const bool was_busy = posted_[w] && !done(w);
  posted_[w] = 0;
  return was_busy;
}

bool FrontChannel::busy() const { return !all_done(); }

int FrontChannel::dead_worker(const std::vector<int>& sentinels, bool only_busy) const {
  for (uint32_t w = 0; w < seq_.size(); ++w) {
    if (only_busy && !posted_[w]) continue;
    if (platform::first_ready_fd(&sentinels[w], 1) < 0) continue;
    // A worker that completed the command and then exited (CLOSE) did not
    // die during it. Read after its sentinel: it completed before it exited.
    if (only_busy && done(w)) continue;
    return static_cast<int>(w) + 1;
  }
  return 0;
}

bool FrontChannel::keep_waiting(const Interrupted& interrupted, const std::vector<int>& sentinels,
                                bool only_busy, int64_t deadline, int& status) const {
  if (interrupted()) return status = kInterrupted, false;
  if (int dead = dead_worker(sentinels, only_busy)) return status = dead, false;
  if (platform::now_ns() >= deadline) return status = kTimedOut, false;
  return true;
}

int FrontChannel::wait(const std::vector<int>& sentinels, double timeout_s,
                       const Interrupted& interrupted) {
  if (sentinels.size() != seq_.size()) throw std::invalid_argument("one sentinel per worker");
  ArenaHeader* h = header();
  const int64_t start = platform::now_ns();
  const int64_t deadline = deadline_after(start, timeout_s);
  int status = kReady;
  auto on_slice = [&]() -> bool {
    return keep_waiting(interrupted, sentinels, true, deadline, status);
  };
  // Ready when every posted worker has published done_id = this command (the
  // truth). We sleep on `completions` and ask to be woken when it reaches
  // seen + (posted workers not seen done). Each of those counts after our load
  // of `seen`: a count before it would have been acquired with its done_id.
  // So the last of them reaches the mark (a late count of an earlier command
  // may reach it sooner: we look again); and as wait_until sleeps only if the
  // word still reads `seen` after it stored `sleeping`, that count comes after
  // the store, sees us sleeping with this mark, and wakes us. Abandoned
  // workers are no longer posted: nobody waits for them.
  bool preempted = false;
  wait_until(h->completions.value, h->front.sleeping, [this](uint32_t) { return all_done(); },
             spin_.budget_ns(start), test_hooks::front_slice(kFrontSliceNs), on_slice,
             [this, h](uint32_t seen) {
               h->front.wake_at.store(seen + busy_count(), std::memory_order_relaxed);
             },
             &preempted);
  if (preempted) spin_.preempted(platform::now_ns());
  if (status == kReady) {
    // Learn how long the workers really took after we started waiting (their
    // completion stamps), not how long we slept: a futex wake-up costs tens of
    // microseconds and would teach us never to spin again.
    int64_t last_done = start;
    for (uint32_t w = 0; w < seq_.size(); ++w)
      if (posted_[w]) last_done = std::max(last_done, control(w)->result.done_ns);
    spin_.observe(last_done - start);
  }
  return status;
}

std::vector<uint32_t> FrontChannel::workers_with_replies() const {
  std::vector<uint32_t> out;
  for (uint32_t w = 0; w < seq_.size(); ++w) {
    const WorkerControl* c = control(w);
    if (posted_[w] && (c->result.status != 0 || c->result.reply_total != 0)) out.push_back(w);
  }
  return out;
}

void FrontChannel::attach_async(AsyncRegion region, std::vector<uint32_t> owner_of_row) {
  if (owner_of_row.size() != region.num_envs) throw std::invalid_argument("one owner per env");
  if (region.rings < seq_.size() || region.rings > seq_.size() + 1)
    throw std::invalid_argument("one pair of rings per worker, and one for the caller's slice if it has one");
  for (uint32_t w : owner_of_row)
    if (w >= region.rings) throw std::invalid_argument("an env's owner has no rings");
  async_ = region;
  owner_ = std::move(owner_of_row);
}

void FrontChannel::send(const std::vector<uint32_t>& rows) {
  if (!async_.base) throw std::logic_error("async mode is not attached");
  std::vector<uint8_t> touched(async_.rings, 0);
  for (uint32_t row : rows) {
    if (row >= owner_.size()) throw std::out_of_range("env row out of range");
    const uint32_t w = owner_[row];
    Ring* r = async_.todo(w);
    const uint32_t tail = r->tail.load(std::memory_order_relaxed);  // we are its only writer
    async_.todo_items(w)[tail & (async_.capacity - 1)] = row;
    // Release: the worker that acquires the new tail sees the item (and the
    // action row written before this call).
    r->tail.store(tail + 1, std::memory_order_release);
    ++sent_count_;
    touched[w] = 1;
  }
  for (uint32_t w = 0; w < seq_.size(); ++w)  // not the caller's own ring: it pops that itself
    if (touched[w]) ring(w);
}

uint32_t FrontChannel::own_ring() const {
  if (!async_.base || async_.rings == seq_.size()) throw std::logic_error("the caller has no async slice");
  return async_.rings - 1;
}

uint32_t FrontChannel::own_pending() const {
  const Ring* r = async_.todo(own_ring());
  return r->tail.load(std::memory_order_relaxed) - r->head.load(std::memory_order_relaxed);  // both ours
}

uint32_t FrontChannel::finished_ready() const {
  // Acquire pairs with each producer's release of its tail.
  uint32_t n = 0;
  for (uint32_t w = 0; w < async_.rings; ++w) {
    const Ring* r = async_.finished(w);
    n += r->tail.load(std::memory_order_acquire) - r->head.load(std::memory_order_relaxed);
  }
  return n;
}

int FrontChannel::wait_finished(uint32_t count, const std::vector<int>& sentinels, double timeout_s,
                                const Interrupted& interrupted) {
  if (!async_.base) throw std::logic_error("async mode is not attached");
  AsyncHeader* h = async_.header();
  const int64_t deadline = deadline_after(platform::now_ns(), timeout_s);
  int status = kReady;
  auto on_slice = [&]() -> bool {
    return keep_waiting(interrupted, sentinels, false, deadline, status);
  };
  // Envs finish one by one: spin only briefly, then sleep until the push
  // that makes `count` ready. A worker wakes us only at a mark of the count:
  // `seen` plus the envs still missing. wait_until loads the count before it
  // reads the rings, so each push not seen there counts after that load
  // (its tail is released before its count); the one that completes the
  // batch reaches the mark at the latest, and sees us sleeping with it
  // announced (the argument of FrontChannel::wait). Pushes in the rings not
  // counted yet only wake us early.
  wait_until(h->finished_count.value, h->front.sleeping,
             [this, count](uint32_t) { return finished_ready() >= count; }, 2'000,
             test_hooks::front_slice(kFrontSliceNs), on_slice, [this, h, count](uint32_t seen) {
               const uint32_t ready = finished_ready();
               h->front.wake_at.store(seen + (ready < count ? count - ready : 0), std::memory_order_relaxed);
             });
  return status;
}

std::vector<std::pair<uint32_t, uint32_t>> FrontChannel::async_progress() const {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (uint32_t w = 0; w < async_.rings; ++w) {
    const uint32_t done = async_.finished(w)->tail.load(std::memory_order_acquire);
    out.emplace_back(done, async_.todo(w)->tail.load(std::memory_order_relaxed) - done);
  }
  return out;
}

void FrontChannel::reset_async_worker(uint32_t w) {
  if (w >= seq_.size()) throw std::out_of_range("worker index out of range");
  for (Ring* r : {async_.todo(w), async_.finished(w)}) {
    r->head.store(0, std::memory_order_relaxed);
    r->tail.store(0, std::memory_order_relaxed);
  }
}

std::vector<uint32_t> FrontChannel::pop_finished(uint32_t count) {
  // The `count` oldest tickets. Each worker's tickets increase along its
  // ring, so they are a prefix of every ring: merge the rings' heads rather
  // than gather and sort all that is ready. When the workers run ahead of
  // the caller, most envs sit finished in the rings: a recv() reads the ones
  // it takes and one more per ring, not every one (docs/performance.md,
  // "Sixteen vCPUs").
  struct Head {
    uint64_t ticket;
    uint32_t worker;
  };
  const auto later = [](const Head& a, const Head& b) { return a.ticket > b.ticket; };  // min-heap
  const uint32_t workers = async_.rings;  // the caller's slice's too
  const uint32_t mask = async_.capacity - 1;
  std::vector<uint32_t> next(workers), tails(workers);
  std::vector<Head> heads;
  heads.reserve(workers);
  uint64_t ready = 0;
  for (uint32_t w = 0; w < workers; ++w) {
    const Ring* r = async_.finished(w);
    next[w] = r->head.load(std::memory_order_relaxed);  // we are its only writer
    // Acquire pairs with the producer's release of its tail, so the items
    // and the envs' results are visible.
    tails[w] = r->tail.load(std::memory_order_acquire);
    ready += tails[w] - next[w];
    if (next[w] != tails[w]) heads.push_back({async_.finished_items(w)[next[w] & mask].ticket, w});
  }
  if (ready < count) throw std::logic_error("fewer finished envs than asked for");
  std::make_heap(heads.begin(), heads.end(), later);
  std::vector<uint32_t> rows(count);
  for (uint32_t i = 0; i < count; ++i) {
    std::pop_heap(heads.begin(), heads.end(), later);
    const uint32_t w = heads.back().worker;
    const FinishedItem* items = async_.finished_items(w);
    rows[i] = items[next[w]++ & mask].row;
    if (next[w] != tails[w]) {
      heads.back().ticket = items[next[w] & mask].ticket;
      std::push_heap(heads.begin(), heads.end(), later);
    } else {
      heads.pop_back();
    }
  }
  for (uint32_t w = 0; w < workers; ++w) {
    Ring* r = async_.finished(w);
    if (r->head.load(std::memory_order_relaxed) != next[w]) r->head.store(next[w], std::memory_order_relaxed);
  }
  return rows;
}

// -------------------------------------------------------------- WorkerChannel

WorkerChannel::WorkerChannel(char* base, FixedLayout layout, uint32_t worker, int parent_fd)
    : base_(base), layout_(layout), worker_(worker), parent_fd_(parent_fd), spin_(5'000, AdaptiveSpin::kSpinCapNs) {
  if (worker >= layout.num_workers) throw std::invalid_argument("bad worker index");
  seen_ = control()->cmd_seq.value.load(std::memory_order_acquire);
  // A command posted before we started (or one a dead predecessor in this
  // slot never completed) is new to us; completed ones are not.
  handled_id_ = control()->done_id.value.load(std::memory_order_acquire);
  current_id_ = handled_id_;
}

bool WorkerChannel::wait_doorbell() {
  WorkerControl* c = control();
  const int64_t start = platform::now_ns();
  const uint32_t seen = seen_;
  const auto rung = [seen](uint32_t v) { return v != seen; };
  int64_t spin_ns = spin_.budget_ns(start);
  // Not while spinning is backed off (a lost core): the spin after it would
  // lose its core too.
  const int64_t doze_ns = spin_ns > 0 ? forecast_.doze_ns(start) : 0;
  bool dozed = false;
  if (doze_ns > 0 && !wait_until(c->cmd_seq.value, c->worker_sleeping.value, rung, 0, doze_ns, [] { return false; })) {
    dozed = true;
    forecast_.woke_late(platform::now_ns() - start - doze_ns);
    spin_ns = forecast_.spin_after_doze_ns();
  }
  bool preempted = false;
  bool ok = wait_until(
      c->cmd_seq.value, c->worker_sleeping.value, rung, spin_ns, kWorkerSliceNs,
      [this] { return platform::first_ready_fd(&parent_fd_, 1) < 0; }, &preempted);
  if (preempted) spin_.preempted(platform::now_ns());
  if (dozed) forecast_.spun(preempted, platform::now_ns());
  if (!ok) return false;
  seen_ = c->cmd_seq.value.load(std::memory_order_acquire);
  // The front end's pace: when it posted, not when we woke up. A ring may be
  // for async work, or for a command we already took, while the front end
  // posts the next one: the stamp may belong to any of them, which only
  // blurs a hint; relaxed is enough, atomic so that it is never torn.
  const int64_t waited_ns = std::max<int64_t>(0, c->command.posted_ns.load(std::memory_order_relaxed) - start);
  spin_.observe(waited_ns);
  forecast_.observe(waited_ns);
  return true;
}

bool WorkerChannel::take_command() {
  const uint32_t id = control()->command.id.load(std::memory_order_acquire);
  if (id == handled_id_) return false;
  handled_id_ = current_id_ = id;
  return true;
}

void WorkerChannel::complete(int32_t status, uint64_t reply_len, uint64_t reply_total) {
  WorkerControl* c = control();
  c->result.status = status;
  c->result.reply_len = reply_len;
  c->result.reply_total = reply_total;
  c->result.done_ns = platform::now_ns();
  c->done_id.value.store(current_id_, std::memory_order_release);
  test_hooks::on_between_publish_and_count(worker_);
  ArenaHeader* h = layout_.header(base_);
  // Counted after publishing: a front end that acquires the count sees
  // done_id. seq_cst pairs with the front end's (store sleeping, load
  // completions) in wait_until; wake_at is released by its store of sleeping.
  const uint32_t count = h->completions.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (h->front.sleeping.load(std::memory_order_seq_cst) &&
      static_cast<int32_t>(count - h->front.wake_at.load(std::memory_order_relaxed)) >= 0)
    platform::futex_wake(&h->completions.value, 1);
}

bool WorkerChannel::pop_todo(uint32_t* row) { return shmvec::pop_todo(async_, worker_, row); }

void WorkerChannel::push_finished(uint32_t row) { shmvec::push_finished(async_, worker_, row); }

// ------------------------------------------------------------ a stepper's rings

bool pop_todo(const AsyncRegion& region, uint32_t stepper, uint32_t* row) {
  Ring* r = region.todo(stepper);
  const uint32_t head = r->head.load(std::memory_order_relaxed);  // we are its only writer
  // Acquire pairs with the front end's release of the tail: we see the row
  // and the action written for it.
  if (head == r->tail.load(std::memory_order_acquire)) return false;
  *row = region.todo_items(stepper)[head & (region.capacity - 1)];
  r->head.store(head + 1, std::memory_order_relaxed);  // nobody waits for space
  return true;
}

void push_finished(const AsyncRegion& region, uint32_t stepper, uint32_t row) {
  AsyncHeader* h = region.header();
  Ring* r = region.finished(stepper);
  const uint32_t tail = r->tail.load(std::memory_order_relaxed);  // we are its only writer
  FinishedItem& item = region.finished_items(stepper)[tail & (region.capacity - 1)];
  item.ticket = h->next_ticket.fetch_add(1, std::memory_order_relaxed);
  item.row = row;
  // Release: the front end that sees the tail sees the item and the env's results.
  r->tail.store(tail + 1, std::memory_order_release);
  // Counted only after publishing, so the count never runs ahead of what can
  // be popped. seq_cst pairs with the front end's (store sleeping, load count).
  // wake_at is released by the front end's store of sleeping.
  const uint32_t count = h->finished_count.value.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (h->front.sleeping.load(std::memory_order_seq_cst) &&
      static_cast<int32_t>(count - h->front.wake_at.load(std::memory_order_relaxed)) >= 0)
    platform::futex_wake(&h->finished_count.value, 1);
}

}  // namespace shmvec
