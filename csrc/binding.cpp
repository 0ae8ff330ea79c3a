// Python binding of the core. It translates: it releases the GIL around
// waits, turns pending signals into exceptions, and runs the worker's serve
// loop, which hands plain steps to the native stepper without returning to
// Python.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_set>

#include "arena.hpp"
#include "channel.hpp"
#include "info_columns.hpp"
#include "platform.hpp"
#include "python_calls.hpp"
#include "row_array.hpp"
#include "stepper.hpp"

namespace py = pybind11;
using namespace shmvec;

namespace {

constexpr uint32_t kStepCommand = 1;

std::vector<uint32_t> row_vector(const RowArray& rows) {
  check_rows_1d(rows);
  std::vector<uint32_t> out(static_cast<std::size_t>(rows.shape(0)));
  const int64_t* row = rows.data();
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (row[i] < 0 || row[i] > UINT32_MAX) throw py::index_error("env row out of range");
    out[i] = static_cast<uint32_t>(row[i]);
  }
  return out;
}

// What is wrong with send()'s env ids, checked against the envs in flight (a
// bool per env) in three passes over them, in the order the front end reports
// it: 0 nothing, 1 one out of [0, num_envs), 2 one repeated, 3 one in flight.
// One native call instead of a few numpy reductions on every send().
int env_ids_problem(const RowArray& ids, const bool* busy, int64_t num_envs) {
  check_rows_1d(ids, "env ids must be 1-D");
  const int64_t* id = ids.data();
  const py::ssize_t count = ids.shape(0);
  for (py::ssize_t i = 0; i < count; ++i)
    if (id[i] < 0 || id[i] >= num_envs) return 1;
  std::vector<uint8_t> seen(static_cast<std::size_t>(num_envs), 0);
  for (py::ssize_t i = 0; i < count; ++i) {
    if (seen[id[i]]) return 2;
    seen[id[i]] = 1;
  }
  for (py::ssize_t i = 0; i < count; ++i)
    if (busy[id[i]]) return 3;
  return 0;
}

// Async mode's mask of the envs in flight (a bool per env), which the native
// send and hand-out update in place: the front end's own array, never a
// converted copy, whose changes would be lost.
bool* mask_data(py::array& mask) {
  if (mask.dtype().kind() != 'b' || mask.ndim() != 1 || !(mask.flags() & py::array::c_style) ||
      !mask.writeable())
    throw std::invalid_argument("the in-flight mask must be a writable 1-D bool array");
  return static_cast<bool*>(mask.mutable_data());
}

// The bytes of one env's row of an array whose first axis is the env: its
// other axes must be C-contiguous, so that a row is one memcpy.
std::size_t row_bytes(const py::array& a, const char* what) {
  if (a.ndim() < 1) throw std::invalid_argument(std::string(what) + " has no env axis");
  py::ssize_t bytes = a.itemsize();
  for (py::ssize_t d = a.ndim() - 1; d >= 1; --d) {
    if (a.strides(d) != bytes) throw std::invalid_argument(std::string(what) + "'s rows are not contiguous");
    bytes *= a.shape(d);
  }
  return static_cast<std::size_t>(bytes);
}

// Whether two dtypes store values alike, so that rows copy as bytes (numpy's
// int64 and longlong do, though they are different dtype objects).
bool same_storage(const py::dtype& a, const py::dtype& b) {
  return a.kind() == b.kind() && a.itemsize() == b.itemsize() && a.byteorder() == b.byteorder() &&
         !a.has_fields() && !b.has_fields();
}

// Writes `values[k]` (one row per env of `ids`, C-contiguous, in the dtype of
// `views[k]`) into rows `ids` of `views[k]` (the arena's action leaves), one
// memcpy a row: numpy's fancy assignment of a 2-D batch takes microseconds.
// Everything is checked before the first row is written.
void write_rows(const RowArray& ids, const py::list& views, const py::list& values) {
  check_rows_1d(ids);
  if (views.size() != values.size()) throw std::invalid_argument("one batch of values per view");
  const int64_t* id = ids.data();
  const py::ssize_t count = ids.shape(0);
  struct Leaf {
    char* base;
    py::ssize_t stride;
    const char* src;
    std::size_t bytes;
  };
  std::vector<Leaf> leaves;
  for (std::size_t k = 0; k < views.size(); ++k) {
    // Arrays only, not converted copies: the rows are written after this loop.
    if (!py::isinstance<py::array>(views[k]) || !py::isinstance<py::array>(values[k]))
      throw std::invalid_argument("action views and batches must be numpy arrays");
    auto view = py::reinterpret_borrow<py::array>(views[k]);
    auto value = py::reinterpret_borrow<py::array>(values[k]);
    const std::size_t bytes = row_bytes(view, "an action view");
    if (!same_storage(value.dtype(), view.dtype()) || value.ndim() != view.ndim() || value.shape(0) != count ||
        !(value.flags() & py::array::c_style) || row_bytes(value, "an action batch") != bytes)
      throw std::invalid_argument("an action batch does not match its view");
    if (!view.writeable()) throw std::invalid_argument("an action view is read-only");
    for (py::ssize_t i = 0; i < count; ++i)
      if (id[i] < 0 || id[i] >= view.shape(0)) throw py::index_error("env row out of range");
    leaves.push_back({static_cast<char*>(view.mutable_data()), view.strides(0),
                      static_cast<const char*>(value.data()), bytes});
  }
  for (const Leaf& leaf : leaves)
    for (py::ssize_t i = 0; i < count; ++i)
      std::memcpy(leaf.base + id[i] * leaf.stride, leaf.src + i * leaf.bytes, leaf.bytes);
}

// Raises OSError(err, "what: strerror"), whose errno callers can tell apart
// (EMFILE, ENOMEM); pybind11 would make a std::system_error a RuntimeError.
[[noreturn]] void throw_errno(int err, const char* what) {
  PyErr_SetObject(PyExc_OSError, py::make_tuple(err, std::string(what) + ": " + std::strerror(err)).ptr());
  throw py::error_already_set();
}

class Mapping;
// Every Mapping of this process, so that a forked worker can unmap those it
// inherited. Only touched with the GIL held (Python makes and frees them).
std::unordered_set<Mapping*>& all_mappings() {
  static auto* mappings = new std::unordered_set<Mapping*>();  // never destroyed: no exit-order trouble
  return *mappings;
}

// A MAP_SHARED mapping of an arena file. Exposes the buffer protocol, so numpy
// arrays are views onto it and keep it mapped as long as they live.
class Mapping {
 public:
  Mapping(int fd, std::size_t size) : size_(size) {
    base_ = static_cast<char*>(platform::map_shared(fd, size));
    if (!base_) throw_errno(errno, "mmap of the shmvec arena");
    all_mappings().insert(this);
  }
  ~Mapping() {
    all_mappings().erase(this);
    platform::unmap(base_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  char* base() const { return base_; }
  std::size_t size() const { return size_; }
  // Unmaps it for good; views made before must never be touched again.
  void unmap() {
    platform::unmap(base_, size_);
    base_ = nullptr;
    size_ = 0;
  }

 private:
  char* base_;
  std::size_t size_;
};

FixedLayout fixed_layout(uint32_t workers, uint64_t req, uint64_t rep) { return {workers, req, rep}; }

AsyncRegion async_region(const Mapping& data, std::size_t offset, uint32_t num_envs,
                         uint32_t rings, uint64_t record_capacity) {
  if (offset + AsyncRegion::size(num_envs, rings, record_capacity) > data.size())
    throw std::invalid_argument("async region outside the arena");
  return AsyncRegion(data.base() + offset, num_envs, rings, record_capacity);
}

// A worker's warnings kept for the caller (see warning_relay.py): none on
// almost every step, so one length check decides whether Python must run.
struct KeptWarnings {
  explicit KeptWarnings(py::handle relay)
      : relay(relay), pending(relay.is_none() ? py::object() : relay.attr("pending")) {}
  bool any() const { return pending && PyList_GET_SIZE(pending.ptr()) > 0; }
  py::handle relay;  // a WorkerRelay, or None in the caller
  py::object pending;
};

// Steps one async env and writes its record slot: the record the stepper
// returns (pickled by `dumps`; with the warnings the step raised, wrapped by
// the relay), or the env's exception (encode_error(exc, row) -> bytes),
// which recv() raises. A record too large for its slot waits in `overflow`
// for the front end to fetch it, until the env's next step: a batch that a
// Ctrl-C kept for the next recv() fetches it again. The caller's own slice passes
// `pass_interrupts`: a KeyboardInterrupt (a second Ctrl-C) is not the env's
// error but stops recv(); the env is left with no record.
void step_async_row(const AsyncRegion& region, Stepper& stepper, uint32_t row, py::object& dumps,
                    py::object& encode_error, py::dict& overflow, bool pass_interrupts,
                    const KeptWarnings& kept) {
  RecordSlot* slot = region.record(row);
  slot->length = slot->is_error = slot->overflow = 0;  // no record, unless the step leaves one
  if (PyDict_GET_SIZE(overflow.ptr()) != 0 && PyDict_DelItem(overflow.ptr(), py::int_(row).ptr()) != 0)
    PyErr_Clear();  // (KeyError: its last step's record was not kept here)
  py::object record;
  try {
    record = stepper.step_row(row);
    if (kept.any()) record = call_python(kept.relay.attr("wrap"), record);
    if (!record.is_none()) record = call_python(dumps, record);
  } catch (py::error_already_set& e) {
    if (pass_interrupts && e.matches(PyExc_KeyboardInterrupt)) throw;
    if (e.trace()) PyException_SetTraceback(e.value().ptr(), e.trace().ptr());
    record = call_python(encode_error, e.value(), py::int_(row));
    slot->is_error = 1;
  }
  if (!record.is_none()) {
    const auto len = static_cast<uint64_t>(PyBytes_GET_SIZE(record.ptr()));
    slot->length = static_cast<int64_t>(len);
    if (len <= region.record_capacity) {
      std::memcpy(region.record_data(row), PyBytes_AS_STRING(record.ptr()), len);
    } else {
      overflow[py::int_(row)] = record;  // fetched by the front end
      slot->overflow = 1;
    }
  }
}

// Python runs signal handlers, and so raises their exceptions
// (KeyboardInterrupt), in its main thread only. The thread that is main in
// a fork child is the one that forked.
std::atomic<unsigned long> g_main_thread{0};

bool in_main_thread() { return PyThread_get_thread_ident() == g_main_thread.load(std::memory_order_relaxed); }

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Takes the GIL back after a wait without it. A thread other than the main
// one (which is the one that finalizes) that comes back while the
// interpreter finalizes waits for the process to end (see python_calls.hpp).
// Not a destructor: CPython's pthread_exit, unwinding through a noexcept
// one such as pybind11's gil_scoped_release destructor, calls
// std::terminate() (the program aborted, its exit status lost).
void take_gil_back(PyThreadState* tstate) {
  if (interpreter_finalizing() && !in_main_thread())
    for (;;) pause();
  restore_thread(tstate);  // finalization may begin as it waits for the GIL
}

// wait() with the GIL released; the GIL is taken back as it returns or throws.
template <class Wait>
auto without_gil(Wait&& wait) -> decltype(wait()) {
  PyThreadState* tstate = PyEval_SaveThread();
  try {
    auto result = wait();
    take_gil_back(tstate);
    return result;
  } catch (...) {
    take_gil_back(tstate);
    throw;
  }
}

// Called between sleeps with the GIL released: runs Python's signal handlers
// (which may raise KeyboardInterrupt) and says whether one raised. Other
// threads have none to run, and need not take the GIL for it.
bool signal_pending() {
  if (!in_main_thread()) return false;
  py::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;
}

int checked(int status) {
  if (status == kInterrupted) throw py::error_already_set();  // the handler's exception
  return status;
}

// Async mode's envs that finished and are not yet handed to the user, in the
// order they finished. recv() appends the rows it pops from the rings in the
// same native call (no Ctrl-C can land between); the front end reads them as
// int64 arrays, with no Python int per env.
class RowQueue {
 public:
  std::size_t size() const { return rows_.size(); }
  // The first `n` rows, as a new int64 array.
  py::array_t<int64_t> head(std::size_t n) const {
    if (n > rows_.size()) throw py::index_error("fewer rows queued than asked for");
    py::array_t<int64_t> out(static_cast<py::ssize_t>(n));
    std::copy_n(rows_.begin(), n, out.mutable_data());
    return out;
  }
  void drop(std::size_t n) { rows_.erase(rows_.begin(), rows_.begin() + std::min(n, rows_.size())); }
  const int64_t* data() const { return rows_.data(); }
  void clear() { rows_.clear(); }
  void extend(const RowArray& rows) {
    check_rows_1d(rows);
    rows_.insert(rows_.end(), rows.data(), rows.data() + rows.shape(0));
  }
  void extend(const std::vector<uint32_t>& rows) { rows_.insert(rows_.end(), rows.begin(), rows.end()); }

 private:
  std::vector<int64_t> rows_;
};

// recv()'s hand-out, in one native call that a Ctrl-C cannot cut: the first
// `count` envs of `finished` leave it and are marked not in flight, and
// `batch` (their results) is kept as front._handed_out until recv() returns
// it. Everything is checked before anything changes.
void hand_out(RowQueue& finished, std::size_t count, py::array& in_flight, const py::object& front,
              const py::object& batch) {
  bool* busy = mask_data(in_flight);
  if (count > finished.size()) throw py::index_error("fewer rows queued than asked for");
  const int64_t* row = finished.data();
  for (std::size_t i = 0; i < count; ++i)
    if (row[i] < 0 || row[i] >= in_flight.shape(0)) throw py::index_error("env row out of range");
  for (std::size_t i = 0; i < count; ++i) busy[row[i]] = false;
  finished.drop(count);
  py::setattr(front, "_handed_out", batch);
}

// The front end's channel, bound to the mappings it points into.
class PyFrontChannel {
 public:
  PyFrontChannel(std::shared_ptr<Mapping> mapping, uint32_t num_workers, uint64_t request_capacity,
                 uint64_t reply_capacity, bool initialize)
      : mapping_(check_size(std::move(mapping), num_workers, request_capacity, reply_capacity)),
        channel_(mapping_->base(), fixed_layout(num_workers, request_capacity, reply_capacity),
                 initialize),
        all_(num_workers) {
    for (uint32_t w = 0; w < num_workers; ++w) all_[w] = w;
  }

  void post(const std::vector<uint32_t>& workers, uint32_t code, uint32_t arg,
            const std::vector<uint64_t>& lens) {
    channel_.post(workers, code, arg, lens);
  }
  void post_step_all() { channel_.post(all_, kStepCommand, 0, {}); }
  int wait(const std::vector<int>& sentinels, double timeout_s) {
    return checked(without_gil([&] { return channel_.wait(sentinels, timeout_s, signal_pending); }));
  }
  bool busy() const { return channel_.busy(); }
  uint32_t posted_id() const { return channel_.posted_id(); }
  bool abandon(uint32_t w) { return channel_.abandon(w); }
  std::vector<uint32_t> busy_workers() const { return channel_.busy_workers(); }
  py::tuple result(uint32_t w) const {
    if (w >= all_.size()) throw py::index_error("worker index out of range");
    const auto& r = channel_.control_of(w).result;
    return py::make_tuple(r.status, r.reply_len, r.reply_total);
  }
  std::vector<uint32_t> workers_with_replies() const { return channel_.workers_with_replies(); }

  void attach_async(std::shared_ptr<Mapping> data, std::size_t offset, uint32_t num_envs,
                    uint64_t record_capacity, std::vector<uint32_t> owner_of_row, uint32_t rings) {
    channel_.attach_async(async_region(*data, offset, num_envs, rings, record_capacity), std::move(owner_of_row));
    data_ = std::move(data);
  }
  // The caller's own slice in async mode: steps its queued envs one by one,
  // as a worker would (see step_async_row), while fewer than `count` envs
  // are finished; with `at_least_one`, one even if they are (so that the
  // slice's envs never wait for good behind fast workers). Returns how many
  // it stepped.
  uint32_t step_own(Stepper& stepper, uint32_t count, bool at_least_one, py::object dumps,
                    py::object encode_error, py::dict overflow) {
    const AsyncRegion& r = region();
    uint32_t stepped = 0, row;
    while ((at_least_one && stepped == 0) || channel_.finished_ready() < count) {
      if (!channel_.pop_own(&row)) break;
      try {
        step_async_row(r, stepper, row, dumps, encode_error, overflow, true, KeptWarnings(py::none()));
      } catch (...) {
        channel_.push_own(row);  // stepped or not, it is not lost in flight
        throw;
      }
      channel_.push_own(row);
      ++stepped;
    }
    return stepped;
  }
  uint32_t own_pending() const { return channel_.own_pending(); }
  void send(const RowArray& rows) { channel_.send(row_vector(rows)); }
  // send() in one call: checks the env ids against the envs in flight (a
  // problem, as env_ids_problem says it, is returned and nothing is done),
  // writes their actions into the arena (see write_rows), queues them to
  // their workers and marks them in flight. No Python runs within it, so a
  // Ctrl-C lands before it or after it.
  int send_actions(const RowArray& ids, py::array in_flight, const py::list& views, const py::list& values) {
    bool* busy = mask_data(in_flight);
    if (const int problem = env_ids_problem(ids, busy, in_flight.shape(0))) return problem;
    write_rows(ids, views, values);
    const std::vector<uint32_t> rows = row_vector(ids);
    channel_.send(rows);
    for (uint32_t row : rows) busy[row] = true;
    return 0;
  }
  uint64_t sent_count() const { return channel_.sent_count(); }
  uint32_t finished_ready() const { return channel_.finished_ready(); }
  // Waits until `count` envs have finished, then pops them in finishing
  // order onto the end of `into`. Returns the status: rows only when it is
  // 0; nothing is popped otherwise, so an interrupted wait loses no env. No
  // Python code runs between the pop and the append, so no Ctrl-C can land
  // between them either.
  int recv(uint32_t count, const std::vector<int>& sentinels, double timeout_s, RowQueue& into) {
    const int status = wait_finished(count, sentinels, timeout_s);
    if (status != kReady) return status;
    into.extend(channel_.pop_finished(count));
    return status;
  }
  // recv()'s usual batch in one call (see SendRecv.recv): waits as recv()
  // does for `count` envs to finish (a failed wait returns its status, with
  // nothing popped) and pops them onto `finished`. If one of them has an
  // async record (infos that are not columns, an episode's end, an error),
  // or has its info in columns while `info_columns` is None (the slices
  // have not all shown one schema yet), or an info key "env_id" of its
  // own, it returns None and leaves them there for the Python path.
  // Otherwise it copies their rows of `sources` (observations, rewards,
  // terminations, truncations) into new arrays, reads their infos from the
  // columns (see info_batch) and hands them out (see hand_out) as the batch
  // it returns: (those four, infos), with infos["env_id"] their ids.
  py::object take_batch(uint32_t count, const std::vector<int>& sentinels, double timeout_s, RowQueue& finished,
                        py::array in_flight, const py::list& sources, const py::array& info_flags,
                        const py::object& info_columns, const py::object& front) {
    if (finished.size() != 0) throw std::logic_error("take_batch: envs are at hand already");
    if (sources.size() != 4) throw std::invalid_argument("take_batch: four sources");
    const uint8_t* flags = info_flag_bytes(info_flags, region().num_envs, "take_batch");
    const int status = recv(count, sentinels, timeout_s, finished);
    if (status != kReady) return py::int_(status);
    py::array_t<int64_t> ids = finished.head(count);
    const int64_t* row = ids.data();
    bool any_info = false;
    for (uint32_t i = 0; i < count; ++i) {
      if (region().record(check_row(static_cast<uint32_t>(row[i])))->length) return py::none();
      any_info = any_info || flags[row[i]];
    }
    if (any_info && info_columns.is_none()) return py::none();
    py::list arrays;
    for (const auto& item : sources) {
      if (!py::isinstance<py::array>(item)) throw std::invalid_argument("take_batch: a source is not an array");
      auto source = py::reinterpret_borrow<py::array>(item);
      if (source.ndim() < 1 || source.shape(0) != region().num_envs)
        throw std::invalid_argument("take_batch: a source without a row per env");
      const std::size_t bytes = row_bytes(source, "a source");
      std::vector<py::ssize_t> shape(source.shape(), source.shape() + source.ndim());
      shape[0] = count;
      py::array out(source.dtype(), shape);
      const char* from = static_cast<const char*>(source.data());
      char* to = static_cast<char*>(out.mutable_data());
      for (uint32_t i = 0; i < count; ++i) std::memcpy(to + i * bytes, from + row[i] * source.strides(0), bytes);
      arrays.append(std::move(out));
    }
    py::dict infos = any_info ? info_batch(info_flags, py::reinterpret_borrow<py::list>(info_columns), ids)
                              : py::dict();
    if (infos.contains("env_id")) return py::none();  // an env's own: the Python path says so
    infos["env_id"] = ids;
    py::tuple batch = py::make_tuple(arrays[0], arrays[1], arrays[2], arrays[3], infos);
    hand_out(finished, count, in_flight, front, batch);
    return std::move(batch);
  }
  // Waits as recv() does, popping nothing: a WaitStatus. Only reads the
  // rings, so another thread may send() meanwhile (a Ray actor does).
  int wait_finished(uint32_t count, const std::vector<int>& sentinels, double timeout_s) {
    // Already there (the usual case when the workers keep ahead): no wait, so
    // the GIL is kept; letting it go and taking it back costs more than this.
    if (channel_.async_region().base && channel_.finished_ready() >= count) return kReady;
    return checked(
        without_gil([&] { return channel_.wait_finished(count, sentinels, timeout_s, signal_pending); }));
  }
  std::vector<std::pair<uint32_t, uint32_t>> async_progress() const { return channel_.async_progress(); }
  void reset_async_worker(uint32_t w) { channel_.reset_async_worker(w); }
  int first_dead(const std::vector<int>& sentinels) const {
    if (sentinels.size() != all_.size()) throw std::invalid_argument("one sentinel per worker");
    return channel_.first_dead(sentinels);
  }
  // (length, is_error, overflow) of an env's async record.
  py::tuple record(uint32_t row) const {
    const RecordSlot* slot = region().record(check_row(row));
    return py::make_tuple(slot->length, slot->is_error, slot->overflow);
  }
  // The rows among `rows` whose async record is not empty (most steps have
  // none): one call per recv() instead of one per env.
  std::vector<uint32_t> rows_with_records(const RowArray& rows) const {
    std::vector<uint32_t> out;
    for (uint32_t row : row_vector(rows))
      if (region().record(check_row(row))->length) out.push_back(row);
    return out;
  }
  py::bytes record_bytes(uint32_t row) const {
    const RecordSlot* slot = region().record(check_row(row));
    if (slot->overflow) throw std::logic_error("the record overflowed its slot");
    return py::bytes(region().record_data(row), static_cast<size_t>(slot->length));
  }

 private:
  static std::shared_ptr<Mapping> check_size(std::shared_ptr<Mapping> m, uint32_t w, uint64_t req,
                                             uint64_t rep) {
    if (fixed_layout(w, req, rep).size() > m->size()) throw std::invalid_argument("arena smaller than its layout");
    return m;
  }
  const AsyncRegion& region() const {
    if (!channel_.async_region().base) throw std::logic_error("async mode is not attached");
    return channel_.async_region();
  }
  uint32_t check_row(uint32_t row) const {
    if (row >= region().num_envs) throw py::index_error("env row out of range");
    return row;
  }

  std::shared_ptr<Mapping> mapping_, data_;
  FrontChannel channel_;
  std::vector<uint32_t> all_;
};

// A worker's channel, and its serve loop.
class PyWorkerChannel {
 public:
  PyWorkerChannel(std::shared_ptr<Mapping> mapping, uint32_t worker, uint32_t num_workers,
                  uint64_t request_capacity, uint64_t reply_capacity, int parent_fd)
      : mapping_(std::move(mapping)),
        channel_(mapping_->base(), fixed_layout(num_workers, request_capacity, reply_capacity),
                 worker, parent_fd) {
    if (fixed_layout(num_workers, request_capacity, reply_capacity).size() > mapping_->size())
      throw std::invalid_argument("arena smaller than its layout");
    reply_area_ = fixed_layout(num_workers, request_capacity, reply_capacity).reply_area(mapping_->base(), worker);
    reply_capacity_ = reply_capacity;
  }

  // Waits for the next command: (code, arg, request_len), or None when the
  // front end is gone. Async work that rings meanwhile waits for serve().
  py::object wait_command() {
    if (!next_command()) return py::none();
    const auto& c = channel_.control_of().command;
    return py::make_tuple(c.code, c.arg, c.request_len);
  }
  void complete(int32_t status, uint64_t reply_len, uint64_t reply_total) {
    channel_.complete(status, reply_len, reply_total);
  }
  void attach_async(std::shared_ptr<Mapping> data, std::size_t offset, uint32_t num_envs,
                    uint64_t record_capacity, uint32_t rings) {
    channel_.attach_async(async_region(*data, offset, num_envs, rings, record_capacity));
    data_ = std::move(data);
  }

  // Serves steps natively (plain steps and async envs) until a command needs
  // Python: returns (code, arg, request_len, payload), payload being None or
  // the bytes of a step reply that Python sends: one too large for the reply
  // area (sent in chunks by the caller), or one that the warnings kept by
  // `relay` (a WorkerRelay) go ahead of. Env exceptions of plain steps
  // propagate; those of async steps become the env's record
  // (encode_error(exc, row) -> bytes).
  py::tuple serve(Stepper& stepper, py::object dumps, py::object encode_error, py::dict overflow,
                  py::object relay) {
    const KeptWarnings kept(relay);
    for (;;) {
      if (channel_.has_async()) step_async(stepper, dumps, encode_error, overflow, kept);
      if (!channel_.take_command()) {  // nothing new, or the ring was for async work only
        if (!without_gil([&] { return channel_.wait_doorbell(); })) return py::make_tuple(0, 0, 0, py::none());
        continue;
      }
      const auto& c = channel_.control_of().command;
      if (c.code != kStepCommand || c.request_len != 0)
        return py::make_tuple(c.code, c.arg, c.request_len, py::none());
      py::object records = stepper.step(py::none());
      const bool warned = kept.any();
      if (records.is_none() && !warned) {
        channel_.complete(0, 0, 0);
        continue;
      }
      py::bytes data = records.is_none() ? py::bytes() : py::bytes(call_python(dumps, records));
      const auto len = static_cast<uint64_t>(PyBytes_GET_SIZE(data.ptr()));
      if (len > reply_capacity_ || warned) return py::make_tuple(c.code, c.arg, c.request_len, data);
      std::memcpy(reply_area_, PyBytes_AS_STRING(data.ptr()), len);
      channel_.complete(0, len, len);
    }
  }

 private:
  bool next_command() {
    while (!channel_.take_command()) {
      if (!without_gil([&] { return channel_.wait_doorbell(); })) return false;
    }
    return true;
  }

  void step_async(Stepper& stepper, py::object& dumps, py::object& encode_error, py::dict& overflow,
                  const KeptWarnings& kept) {
    uint32_t row;
    while (channel_.pop_todo(&row)) {
      step_async_row(channel_.async_region(), stepper, row, dumps, encode_error, overflow, false, kept);
      channel_.push_finished(row);
    }
  }

  std::shared_ptr<Mapping> mapping_, data_;
  WorkerChannel channel_;
  char* reply_area_;
  uint64_t reply_capacity_;
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "shmvec native core: shared arena, futex signalling, native step loop";
  m.attr("STEP_COMMAND") = kStepCommand;
  // Waits longer than this on average sleep almost at once instead of spinning.
  m.attr("SPIN_CAP_NS") = AdaptiveSpin::kSpinCapNs;
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  pthread_atfork(nullptr, nullptr, [] { g_main_thread = PyThread_get_thread_ident(); });

  m.def("create_shared_file", [](std::size_t size) {
    int fd = platform::create_shared_file(size);
    if (fd < 0) throw_errno(-fd, "memfd_create for the shmvec arena");
    return fd;
  }, py::arg("size"), "Creates an anonymous shared-memory file (memfd) and returns its fd.");
  m.def("resize_shared_file", [](int fd, std::size_t size) {
    int rc = platform::resize_shared_file(fd, size);
    if (rc < 0) throw_errno(-rc, "resizing the shmvec arena");
  }, py::arg("fd"), py::arg("size"));
  m.def("fixed_region_size", [](uint32_t w, uint64_t req, uint64_t rep) {
    return fixed_layout(w, req, rep).size();
  }, py::arg("num_workers"), py::arg("request_capacity"), py::arg("reply_capacity"));
  m.def("area_offsets", [](uint32_t w, uint64_t req, uint64_t rep, uint32_t worker) {
    FixedLayout l = fixed_layout(w, req, rep);
    return py::make_tuple(l.request_area(nullptr, worker) - static_cast<char*>(nullptr),
                          l.reply_area(nullptr, worker) - static_cast<char*>(nullptr));
  }, py::arg("num_workers"), py::arg("request_capacity"), py::arg("reply_capacity"), py::arg("worker"),
     "(request offset, reply offset) of a worker's byte areas in the arena.");
  m.def("exit_when_hung_up", &platform::exit_when_hung_up, py::arg("fd"), py::arg("grace_ns"),
        py::arg("exit_code"),
        "A thread that ends this process `grace_ns` after pipe `fd` hangs up (a worker's parent died).");
  m.def("current_cpu", &platform::current_cpu,
        "The CPU the calling thread runs on now, or -1 if unknown (sched_getcpu, read from the vDSO or "
        "rseq: no system call on current glibc).");
  m.def("unmap_all", [] {
    for (Mapping* m : all_mappings()) m->unmap();
  }, "Unmaps every arena mapping of this process for good (the objects stay, empty): for a "
     "worker made by fork, whose inherited mappings are its parent's, before it maps its own.");
  m.def("check_info", [](py::ssize_t row, py::handle info, const std::string& call) {
    check_info(row, info, call.c_str());
  }, py::arg("row"), py::arg("info"), py::arg("call"),
     "Raises TypeError naming env `row` unless `info`, returned by its `call` (\"step\" or \"reset\"), is a "
     "dict or a mapping.");
  m.def("run_holding_interrupt", [](const py::function& fn, const py::args& args) {
    // A Ctrl-C that came before is raised here, fn not called; one during fn
    // waits for it to return (a second stops it: see platform::hold_interrupt).
    // In another thread no KeyboardInterrupt can cut fn: nothing to hold
    // (and holds of several threads would overlap, keeping it back for good).
    if (!in_main_thread()) {
      call_python_with(fn, args);
      return;
    }
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    platform::hold_interrupt();
    bool released = false;
    struct ReleaseOnThrow {
      bool& released;
      ~ReleaseOnThrow() {
        if (!released) platform::release_interrupt();
      }
    } release_on_throw{released};
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();  // came as the hold began
    call_python_with(fn, args);  // (arguments, not a closure: a closure's cells cost more than the call)
    released = true;
    if (platform::release_interrupt() && PyErr_CheckSignals() != 0) throw py::error_already_set();
  }, py::arg("fn"),
     "Calls fn(*args) with Ctrl-C held: a KeyboardInterrupt that would cut an env's step in two is "
     "raised once fn returns; a second Ctrl-C interrupts fn at once.");
  m.def("hand_out", &hand_out, py::arg("finished"), py::arg("count"), py::arg("in_flight"), py::arg("front"),
        py::arg("batch"),
        "recv()'s hand-out in one call, which a Ctrl-C cannot cut: the first `count` envs of `finished` "
        "leave it and are marked not in flight, and `batch` (their results) is kept as "
        "front._handed_out until recv() returns it.");
  m.def("write_rows", &write_rows, py::arg("ids"), py::arg("views"), py::arg("values"),
        "Writes values[k] (a row per env id) into rows `ids` of views[k], one memcpy a row.");
  m.def("env_ids_problem", [](const RowArray& ids, const py::array_t<bool, py::array::c_style>& in_flight) {
    if (in_flight.ndim() != 1) throw std::invalid_argument("the in-flight mask must be 1-D");
    return env_ids_problem(ids, in_flight.data(), in_flight.shape(0));
  }, py::arg("ids"), py::arg("in_flight"),
        "What is wrong with send()'s env ids: 0 nothing, 1 one is out of range, 2 one is repeated, "
        "3 one is in flight (`in_flight`: a bool per env).");
  m.def("info_batch", &info_batch, py::arg("flags"), py::arg("columns"), py::arg("rows") = py::none(),
        "The infos of a step (or of an async batch's `rows`) from the info columns, as "
        "VectorEnv._add_info builds them (see csrc/info_columns.hpp).");
  m.def("async_region_size", &AsyncRegion::size, py::arg("num_envs"), py::arg("rings"),
        py::arg("record_capacity"));

  py::class_<Mapping, std::shared_ptr<Mapping>>(m, "Mapping", py::buffer_protocol())
      .def(py::init<int, std::size_t>(), py::arg("fd"), py::arg("size"))
      .def_property_readonly("size", &Mapping::size)
      .def_buffer([](Mapping& self) {
        return py::buffer_info(self.base(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(self.size())}, {1});
      });

  py::class_<RowQueue>(m, "RowQueue")
      .def(py::init<>())
      .def("__len__", &RowQueue::size)
      .def("head", &RowQueue::head, py::arg("n"))
      .def("drop", &RowQueue::drop, py::arg("n"))
      .def("clear", &RowQueue::clear)
      .def("extend", py::overload_cast<const RowArray&>(&RowQueue::extend), py::arg("rows"));

  py::class_<PyFrontChannel>(m, "FrontChannel")
      .def(py::init<std::shared_ptr<Mapping>, uint32_t, uint64_t, uint64_t, bool>(),
           py::arg("mapping"), py::arg("num_workers"), py::arg("request_capacity"),
           py::arg("reply_capacity"), py::arg("initialize"))
      .def("post", &PyFrontChannel::post, py::arg("workers"), py::arg("code"), py::arg("arg") = 0,
           py::arg("request_lens") = std::vector<uint64_t>{})
      .def("post_step_all", &PyFrontChannel::post_step_all)
      .def("wait", &PyFrontChannel::wait, py::arg("sentinels"), py::arg("timeout") = -1.0)
      .def_property_readonly("busy", &PyFrontChannel::busy)
      .def_property_readonly("posted_id", &PyFrontChannel::posted_id)
      .def("abandon", &PyFrontChannel::abandon, py::arg("worker"))
      .def("busy_workers", &PyFrontChannel::busy_workers)
      .def("result", &PyFrontChannel::result)
      .def("workers_with_replies", &PyFrontChannel::workers_with_replies)
      .def("attach_async", &PyFrontChannel::attach_async, py::arg("data"), py::arg("offset"),
           py::arg("num_envs"), py::arg("record_capacity"), py::arg("owner_of_row"), py::arg("rings"))
      .def("step_own", &PyFrontChannel::step_own, py::arg("stepper"), py::arg("count"), py::arg("at_least_one"),
           py::arg("dumps"), py::arg("encode_error"), py::arg("overflow"))
      .def_property_readonly("own_pending", &PyFrontChannel::own_pending)
      .def("send", &PyFrontChannel::send, py::arg("rows"))
      .def("send_actions", &PyFrontChannel::send_actions, py::arg("ids"), py::arg("in_flight"),
           py::arg("views"), py::arg("values"))
      .def_property_readonly("finished_ready", &PyFrontChannel::finished_ready)
      .def_property_readonly("sent_count", &PyFrontChannel::sent_count)
      .def("recv", &PyFrontChannel::recv, py::arg("count"), py::arg("sentinels"), py::arg("timeout"),
           py::arg("into"))
      .def("take_batch", &PyFrontChannel::take_batch, py::arg("count"), py::arg("sentinels"), py::arg("timeout"),
           py::arg("finished"), py::arg("in_flight"), py::arg("sources"), py::arg("info_flags"),
           py::arg("info_columns"), py::arg("front"))
      .def("wait_finished", &PyFrontChannel::wait_finished, py::arg("count"), py::arg("sentinels"),
           py::arg("timeout") = -1.0)
      .def("async_progress", &PyFrontChannel::async_progress)
      .def("reset_async_worker", &PyFrontChannel::reset_async_worker, py::arg("worker"))
      .def("first_dead", &PyFrontChannel::first_dead, py::arg("sentinels"))
      .def("record", &PyFrontChannel::record, py::arg("row"))
      .def("record_bytes", &PyFrontChannel::record_bytes, py::arg("row"))
      .def("rows_with_records", &PyFrontChannel::rows_with_records, py::arg("rows"));

  py::class_<PyWorkerChannel>(m, "WorkerChannel")
      .def(py::init<std::shared_ptr<Mapping>, uint32_t, uint32_t, uint64_t, uint64_t, int>(),
           py::arg("mapping"), py::arg("worker"), py::arg("num_workers"),
           py::arg("request_capacity"), py::arg("reply_capacity"), py::arg("parent_fd"))
      .def("wait_command", &PyWorkerChannel::wait_command)
      .def("complete", &PyWorkerChannel::complete, py::arg("status"), py::arg("reply_len") = 0,
           py::arg("reply_total") = 0)
      .def("attach_async", &PyWorkerChannel::attach_async, py::arg("data"), py::arg("offset"),
           py::arg("num_envs"), py::arg("record_capacity"), py::arg("rings"))
      .def("serve", &PyWorkerChannel::serve, py::arg("stepper"), py::arg("dumps"),
           py::arg("encode_error"), py::arg("overflow"), py::arg("relay"));

  py::class_<Stepper>(m, "Stepper")
      .def(py::init<py::list, py::ssize_t, py::list, py::array, py::object, py::list, py::object,
                    py::array, py::array, py::array, int, py::object>(),
           py::arg("envs"), py::arg("first_row"), py::arg("action_leaves"),
           py::arg("action_codes"), py::arg("action_builder"), py::arg("obs_leaves"),
           py::arg("obs_flattener"), py::arg("rewards"), py::arg("terminations"),
           py::arg("truncations"), py::arg("autoreset_mode"), py::arg("write_fallback"))
      .def("step", &Stepper::step, py::arg("object_actions") = py::none())
      .def("step_row", &Stepper::step_row, py::arg("row"))
      .def("write_observation", &Stepper::write_observation, py::arg("row"), py::arg("obs"))
      .def("reset_done", &Stepper::reset_done, py::arg("row"))
      .def("mark_restarted", &Stepper::mark_restarted, py::arg("row"))
      .def("attach_info_columns", &Stepper::attach_info_columns, py::arg("values"), py::arg("flags"),
           py::arg("types"), py::arg("schema_slot"))
      .def_property_readonly("first_row", &Stepper::first_row)
      .def_property_readonly("num_envs", &Stepper::num_envs)
      .def_property_readonly("failed_row", &Stepper::failed_row);
}
