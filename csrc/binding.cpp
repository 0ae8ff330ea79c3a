// Python binding of the core: translates, holds no logic of its own beyond
// releasing the GIL around waits and checking for signals between sleeps.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <unistd.h>

#include "arena.hpp"
#include "platform.hpp"
#include "signal.hpp"
#include "stepper.hpp"

namespace py = pybind11;
using namespace shmvec;

namespace {

constexpr uint32_t kStepCommand = 1;
constexpr int64_t kFrontSliceNs = 20'000'000;    // the front end checks workers and signals every 20 ms
constexpr int64_t kWorkerSliceNs = 100'000'000;  // a worker checks its parent every 100 ms

[[noreturn]] void throw_errno(int err, const char* what) {
  throw std::system_error(err, std::generic_category(), what);
}

// A MAP_SHARED mapping of an arena file. Exposes the buffer protocol, so numpy
// arrays are views onto it and keep it mapped as long as they live.
class Mapping {
 public:
  Mapping(int fd, std::size_t size) : size_(size) {
    base_ = static_cast<char*>(platform::map_shared(fd, size));
    if (!base_) throw_errno(errno, "mmap of the shmvec arena");
  }
  ~Mapping() { platform::unmap(base_, size_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  char* base() const { return base_; }
  std::size_t size() const { return size_; }

 private:
  char* base_;
  std::size_t size_;
};

FixedLayout fixed_layout(uint32_t workers, uint64_t req, uint64_t rep) { return {workers, req, rep}; }

// The front end's side of the control protocol.
class FrontChannel {
 public:
  FrontChannel(std::shared_ptr<Mapping> mapping, uint32_t num_workers, uint64_t request_capacity,
               uint64_t reply_capacity, bool initialize)
      : mapping_(std::move(mapping)),
        layout_(fixed_layout(num_workers, request_capacity, reply_capacity)),
        spin_(2'000, 50'000),
        seq_(num_workers, 0) {
    if (layout_.size() > mapping_->size()) throw std::invalid_argument("arena smaller than its layout");
    ArenaHeader* h = header();
    if (initialize) {
      h->magic = kMagic;
      h->version = kVersion;
      h->num_workers = num_workers;
      h->request_capacity = request_capacity;
      h->reply_capacity = reply_capacity;
    } else if (h->magic != kMagic || h->version != kVersion || h->num_workers != num_workers) {
      throw std::invalid_argument("arena header does not match");
    }
    for (uint32_t w = 0; w < num_workers; ++w)
      seq_[w] = control(w)->cmd_seq.value.load(std::memory_order_relaxed);
  }

  // Hands `code` to each worker in `workers`, with its request length.
  void post(const std::vector<uint32_t>& workers, uint32_t code, uint32_t arg,
            const std::vector<uint64_t>& request_lens) {
    if (!request_lens.empty() && request_lens.size() != workers.size())
      throw std::invalid_argument("one request length per worker");
    if (header()->pending.value.load(std::memory_order_acquire) != 0)
      throw std::logic_error("post() while workers are still busy");
    for (uint32_t w : workers) check_worker(w);
    // Relaxed is enough: the seq_cst store of each cmd_seq below releases it,
    // and workers read it only after acquiring their cmd_seq.
    header()->pending.value.store(static_cast<uint32_t>(workers.size()), std::memory_order_relaxed);
    for (size_t i = 0; i < workers.size(); ++i) {
      WorkerControl* c = control(workers[i]);
      c->command.code = code;
      c->command.arg = arg;
      c->command.request_len = request_lens.empty() ? 0 : request_lens[i];
      publish(c->cmd_seq.value, ++seq_[workers[i]], c->worker_sleeping.value);
    }
  }

  void post_step_all() {
    std::vector<uint32_t> all(seq_.size());
    for (uint32_t w = 0; w < all.size(); ++w) all[w] = w;
    post(all, kStepCommand, 0, {});
  }

  // Waits until every posted worker is done. Returns 0, -1 on timeout, or
  // 1 + the index of a worker whose sentinel fd says it died. Raises
  // KeyboardInterrupt (or whatever a signal handler raises) promptly.
  int wait(const std::vector<int>& sentinels, double timeout_s) {
    if (sentinels.size() != seq_.size()) throw std::invalid_argument("one sentinel per worker");
    ArenaHeader* h = header();
    const int64_t start = platform::now_ns();
    const int64_t deadline =
        timeout_s < 0 ? INT64_MAX : start + static_cast<int64_t>(timeout_s * 1e9);
    int code = 0;
    auto on_slice = [&]() -> bool {
      {
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      }
      for (uint32_t w = 0; w < seq_.size(); ++w) {
        if (control(w)->done_seq.value.load(std::memory_order_acquire) == seq_[w]) continue;
        if (platform::first_ready_fd(&sentinels[w], 1) >= 0) {
          code = static_cast<int>(w) + 1;
          return false;
        }
      }
      if (platform::now_ns() >= deadline) {
        code = -1;
        return false;
      }
      return true;
    };
    {
      py::gil_scoped_release nogil;
      wait_until(h->pending.value, h->front_sleeping.value, [](uint32_t v) { return v == 0; },
                 spin_.budget_ns(), kFrontSliceNs, on_slice);
    }
    if (code == 0) spin_.observe(platform::now_ns() - start);
    return code;
  }

  bool busy() const { return header()->pending.value.load(std::memory_order_acquire) != 0; }

  // (status, reply_len, reply_total) of a worker's last finished command.
  py::tuple result(uint32_t w) const {
    check_worker(w);
    const WorkerControl* c = control(w);
    return py::make_tuple(c->result.status, c->result.reply_len, c->result.reply_total);
  }
  // Workers whose last result has a payload or a non-zero status.
  std::vector<uint32_t> workers_with_replies() const {
    std::vector<uint32_t> out;
    for (uint32_t w = 0; w < seq_.size(); ++w) {
      const WorkerControl* c = control(w);
      if (c->result.status != 0 || c->result.reply_total != 0) out.push_back(w);
    }
    return out;
  }
  void set_spin_limits(int64_t min_ns, int64_t max_ns) { spin_.set_limits(min_ns, max_ns); }

 private:
  ArenaHeader* header() const { return layout_.header(mapping_->base()); }
  WorkerControl* control(uint32_t w) const { return layout_.control(mapping_->base(), w); }
  void check_worker(uint32_t w) const {
    if (w >= seq_.size()) throw py::index_error("worker index out of range");
  }

  std::shared_ptr<Mapping> mapping_;
  FixedLayout layout_;
  AdaptiveSpin spin_;
  std::vector<uint32_t> seq_;  // last cmd_seq published to each worker
};

// A worker's side of the control protocol.
class WorkerChannel {
 public:
  WorkerChannel(std::shared_ptr<Mapping> mapping, uint32_t worker, uint32_t num_workers,
                uint64_t request_capacity, uint64_t reply_capacity, int parent_fd)
      : mapping_(std::move(mapping)),
        layout_(fixed_layout(num_workers, request_capacity, reply_capacity)),
        worker_(worker),
        parent_fd_(parent_fd),
        spin_(5'000, 50'000) {
    if (worker >= num_workers || layout_.size() > mapping_->size())
      throw std::invalid_argument("bad worker index or arena size");
    // Commands after the last one finished in this slot are new to us (the
    // front end may post before we got here).
    seen_ = control()->done_seq.value.load(std::memory_order_acquire);
  }

  // Waits for the next command: (code, arg, request_len), or None when the
  // front end is gone (the pipe only it writes to was closed).
  py::object wait_command() {
    bool parent_alive = true;
    {
      py::gil_scoped_release nogil;
      parent_alive = wait_next();
    }
    if (!parent_alive) return py::none();
    const WorkerControl* c = control();
    return py::make_tuple(c->command.code, c->command.arg, c->command.request_len);
  }

  // Finishes the current command: writes the result, then counts down
  // `pending`; the last worker to finish wakes the front end.
  void complete(int32_t status, uint64_t reply_len, uint64_t reply_total) {
    WorkerControl* c = control();
    c->result.status = status;
    c->result.reply_len = reply_len;
    c->result.reply_total = reply_total;
    c->done_seq.value.store(seen_, std::memory_order_release);
    ArenaHeader* h = layout_.header(mapping_->base());
    // seq_cst pairs with the front end's (store front_sleeping, load pending).
    if (h->pending.value.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        h->front_sleeping.value.load(std::memory_order_seq_cst))
      platform::futex_wake(&h->pending.value, 1);
  }

  // Serves step commands natively until something needs Python: returns
  // (code, arg, request_len, payload) where payload is None, or the bytes of
  // a step reply too large for the reply area (to be sent in chunks). Env
  // exceptions propagate (the caller replies with the error).
  py::tuple serve(Stepper& stepper, py::object dumps) {
    const uint64_t capacity = layout_.reply_capacity;
    char* area = layout_.reply_area(mapping_->base(), worker_);
    for (;;) {
      py::object cmd = wait_command();
      if (cmd.is_none()) return py::make_tuple(0, 0, 0, py::none());
      const WorkerControl* c = control();
      if (c->command.code != kStepCommand || c->command.request_len != 0)
        return py::make_tuple(c->command.code, c->command.arg, c->command.request_len, py::none());
      py::object records = stepper.step(py::none());
      if (records.is_none()) {
        complete(0, 0, 0);
        continue;
      }
      py::bytes data = dumps(records);
      char* buf;
      py::ssize_t len;
      PyBytes_AsStringAndSize(data.ptr(), &buf, &len);
      if (static_cast<uint64_t>(len) > capacity)
        return py::make_tuple(c->command.code, c->command.arg, c->command.request_len, data);
      std::memcpy(area, buf, len);
      complete(0, len, len);
    }
  }

 private:
  WorkerControl* control() const { return layout_.control(mapping_->base(), worker_); }

  bool wait_next() {
    WorkerControl* c = control();
    const int64_t start = platform::now_ns();
    bool ok = wait_until(
        c->cmd_seq.value, c->worker_sleeping.value, [this](uint32_t v) { return v != seen_; },
        spin_.budget_ns(), kWorkerSliceNs,
        [this] { return platform::first_ready_fd(&parent_fd_, 1) < 0; });
    if (!ok) return false;
    spin_.observe(platform::now_ns() - start);
    seen_ = c->cmd_seq.value.load(std::memory_order_acquire);
    return true;
  }

  std::shared_ptr<Mapping> mapping_;
  FixedLayout layout_;
  uint32_t worker_;
  int parent_fd_;
  AdaptiveSpin spin_;
  uint32_t seen_;  // the cmd_seq of the command being (or last) served
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "shmvec native core: shared arena, futex signalling, native step loop";
  m.attr("STEP_COMMAND") = kStepCommand;

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

  py::class_<Mapping, std::shared_ptr<Mapping>>(m, "Mapping", py::buffer_protocol())
      .def(py::init<int, std::size_t>(), py::arg("fd"), py::arg("size"))
      .def_property_readonly("size", &Mapping::size)
      .def_buffer([](Mapping& self) {
        return py::buffer_info(self.base(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(self.size())}, {1});
      });

  py::class_<FrontChannel>(m, "FrontChannel")
      .def(py::init<std::shared_ptr<Mapping>, uint32_t, uint64_t, uint64_t, bool>(),
           py::arg("mapping"), py::arg("num_workers"), py::arg("request_capacity"),
           py::arg("reply_capacity"), py::arg("initialize"))
      .def("post", &FrontChannel::post, py::arg("workers"), py::arg("code"), py::arg("arg") = 0,
           py::arg("request_lens") = std::vector<uint64_t>{})
      .def("post_step_all", &FrontChannel::post_step_all)
      .def("wait", &FrontChannel::wait, py::arg("sentinels"), py::arg("timeout") = -1.0)
      .def_property_readonly("busy", &FrontChannel::busy)
      .def("result", &FrontChannel::result)
      .def("workers_with_replies", &FrontChannel::workers_with_replies)
      .def("set_spin_limits", &FrontChannel::set_spin_limits);

  py::class_<WorkerChannel>(m, "WorkerChannel")
      .def(py::init<std::shared_ptr<Mapping>, uint32_t, uint32_t, uint64_t, uint64_t, int>(),
           py::arg("mapping"), py::arg("worker"), py::arg("num_workers"),
           py::arg("request_capacity"), py::arg("reply_capacity"), py::arg("parent_fd"))
      .def("wait_command", &WorkerChannel::wait_command)
      .def("complete", &WorkerChannel::complete, py::arg("status"), py::arg("reply_len") = 0,
           py::arg("reply_total") = 0)
      .def("serve", &WorkerChannel::serve, py::arg("stepper"), py::arg("dumps"));

  py::class_<Stepper>(m, "Stepper")
      .def(py::init<py::list, py::ssize_t, py::list, py::object, py::list, py::list, py::object,
                    py::array, py::array, py::array, int, py::object>(),
           py::arg("envs"), py::arg("first_row"), py::arg("action_leaves"),
           py::arg("action_builder"), py::arg("obs_leaves"), py::arg("final_obs_leaves"),
           py::arg("obs_flattener"), py::arg("rewards"), py::arg("terminations"),
           py::arg("truncations"), py::arg("autoreset_mode"), py::arg("write_fallback"))
      .def("step", &Stepper::step, py::arg("object_actions") = py::none())
      .def("write_observation", &Stepper::write_observation, py::arg("row"), py::arg("obs"))
      .def("clear_autoreset", &Stepper::clear_autoreset, py::arg("row"))
      .def_property_readonly("first_row", &Stepper::first_row)
      .def_property_readonly("num_envs", &Stepper::num_envs)
      .def_property_readonly("failed_row", &Stepper::failed_row);
}
