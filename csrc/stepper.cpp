#include "stepper.hpp"

#include "new_arrays.hpp"
#include "python_calls.hpp"

#include <cstring>
#include <string>

namespace shmvec {

namespace {

ArrayLeaf make_leaf(py::handle obj) {
  ArrayLeaf leaf;
  leaf.batch = py::reinterpret_borrow<py::array>(obj);
  if (!(leaf.batch.flags() & py::array::c_style) || !leaf.batch.writeable())
    throw std::invalid_argument("arena leaves must be writable C-contiguous arrays");
  leaf.data = static_cast<char*>(leaf.batch.mutable_data());
  leaf.dtype = leaf.batch.dtype();
  leaf.kind = leaf.dtype.kind();
  leaf.itemsize = leaf.dtype.itemsize();
  leaf.row_bytes = leaf.itemsize;
  for (py::ssize_t d = 1; d < leaf.batch.ndim(); ++d) {
    leaf.row_shape.push_back(leaf.batch.shape(d));
    leaf.row_bytes *= leaf.batch.shape(d);
  }
  return leaf;
}

// Leaves given as a list of arrays or None; `targets` gets a pointer per leaf.
void make_leaves(py::list objs, std::vector<ArrayLeaf>& leaves, std::vector<ArrayLeaf*>& targets) {
  leaves.reserve(objs.size());  // no reallocation: targets point into it
  for (py::handle obj : objs) {
    if (obj.is_none()) {
      targets.push_back(nullptr);
    } else {
      leaves.push_back(make_leaf(obj));
      targets.push_back(&leaves.back());
    }
  }
}

[[noreturn]] void raise_value_error(const std::string& msg) {
  PyErr_SetString(PyExc_ValueError, msg.c_str());
  throw py::error_already_set();
}

// Splits an env's return value into exactly `n` items, as tuple unpacking
// would, with an error that names the env and the method.
py::tuple unpack(py::handle result, size_t n, py::ssize_t row, const char* method) {
  py::tuple t;
  if (PyTuple_Check(result.ptr())) {
    t = py::reinterpret_borrow<py::tuple>(result);
  } else {
    PyObject* seq = PySequence_Tuple(result.ptr());
    if (!seq) {
      PyErr_Clear();
      raise_value_error("env " + std::to_string(row) + ": " + method + "() returned " +
                        std::string(py::str(py::type::of(result).attr("__name__"))) +
                        ", expected a tuple of " + std::to_string(n) + " values");
    }
    t = py::reinterpret_steal<py::tuple>(seq);
  }
  if (t.size() != n)
    raise_value_error("env " + std::to_string(row) + ": " + method + "() returned " +
                      std::to_string(t.size()) + " values, expected " + std::to_string(n));
  return t;
}

// Replaces the pending conversion error with one that names the env.
[[noreturn]] void bad_value(py::ssize_t row, const char* what, py::handle value, const char* expected) {
  PyErr_Clear();
  std::string shown = py::repr(value);
  if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
  PyErr_SetString(PyExc_TypeError, ("env " + std::to_string(row) + ": step() returned " + what + " " +
                                    shown + ", expected " + expected).c_str());
  throw py::error_already_set();
}

// Flags on an action code (ACTION_AS_PYTHON and ACTION_AS_GIVEN in
// shmvec._engine.layout).
constexpr uint8_t kActionAsPython = 0x80;
constexpr uint8_t kActionAsGiven = 0x40;

bool is_empty_dict(py::handle obj) { return PyDict_Check(obj.ptr()) && PyDict_GET_SIZE(obj.ptr()) == 0; }

// An info as Gymnasium 1.1+ batches it at once (VectorEnv._add_info): its
// arrays copied, its dicts walked, other values kept. Taken before the
// env's reset, which may overwrite an array the info holds.
py::object info_arrays_copied(py::handle info) {
  if (!PyDict_Check(info.ptr())) return py::reinterpret_borrow<py::object>(info);
  py::dict out;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(info.ptr(), &pos, &key, &value)) {
    py::handle v(value);
    if (PyDict_Check(value))
      out[py::handle(key)] = info_arrays_copied(v);
    else if (py::isinstance<py::array>(v))
      out[py::handle(key)] = call_method(v, py::str("copy"));
    else
      out[py::handle(key)] = v;
  }
  return std::move(out);
}

}  // namespace

void check_info(py::ssize_t row, py::handle info, const char* call) {
  if (PyDict_Check(info.ptr()) || PyObject_HasAttrString(info.ptr(), "items")) return;
  std::string shown = py::repr(info);
  if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
  PyErr_SetString(PyExc_TypeError, ("env " + std::to_string(row) + ": " + call + "() returned info " + shown +
                                    ", expected a dict").c_str());
  throw py::error_already_set();
}

Stepper::Stepper(py::list envs, py::ssize_t first_row, py::list action_leaves,
                 py::array action_codes, py::object action_builder, py::list obs_leaves,
                 py::object obs_flattener, py::array rewards, py::array terminations,
                 py::array truncations, int autoreset_mode, py::object write_fallback)
    : first_row_(first_row),
      action_builder_(std::move(action_builder)),
      obs_flattener_(std::move(obs_flattener)),
      mode_(static_cast<AutoresetMode>(autoreset_mode & ~kCopyFinalInfoArrays)),
      copy_final_info_arrays_((autoreset_mode & kCopyFinalInfoArrays) != 0),
      write_fallback_(std::move(write_fallback)),
      step_name_("step"),
      reset_name_("reset"),
      tolist_name_("tolist"),
      restarted_key_("shmvec_restarted") {
  for (py::handle env : envs) envs_.push_back(py::reinterpret_borrow<py::object>(env));
  needs_reset_.assign(envs_.size(), 0);
  for (py::handle views : action_leaves) {
    action_leaves_.emplace_back();
    if (views.is_none()) continue;
    for (py::handle view : py::reinterpret_borrow<py::list>(views))
      action_leaves_.back().push_back(make_leaf(view));
    if (action_leaves_.back().empty() || action_leaves_.back().size() > 256)
      throw std::invalid_argument("an action leaf needs between 1 and 256 views");
  }
  if (action_codes.dtype().kind() != 'u' || action_codes.itemsize() != 1 ||
      !(action_codes.flags() & py::array::c_style) ||
      action_codes.size() != static_cast<py::ssize_t>(action_leaves_.size()))
    throw std::invalid_argument("action_codes must be a uint8 array with one code per action leaf");
  keep_action_codes_ = action_codes;
  action_codes_ = static_cast<const uint8_t*>(action_codes.data());
  action_is_single_leaf_ = action_builder_.is_none();
  if (action_is_single_leaf_ && (action_leaves_.size() != 1 || action_leaves_[0].empty()))
    throw std::invalid_argument("an action space of one fixed leaf needs exactly one leaf");
  action_leaf_is_row_ = action_is_single_leaf_ && !action_leaves_[0][0].row_shape.empty();
  make_leaves(obs_leaves, obs_leaves_, obs_targets_);
  if (obs_flattener_.is_none() && (obs_targets_.size() != 1 || obs_targets_[0] == nullptr))
    throw std::invalid_argument("an observation space of one fixed leaf needs exactly one leaf");
  auto check_flags = [](py::array& a, const char* kind) {
    if (a.dtype().kind() != kind[0] || !(a.flags() & py::array::c_style))
      throw std::invalid_argument("bad arena array for rewards or flags");
  };
  check_flags(rewards, "f");
  check_flags(terminations, "b");
  check_flags(truncations, "b");
  keep_rewards_ = rewards;
  keep_terminations_ = terminations;
  keep_truncations_ = truncations;
  rewards_ = static_cast<double*>(rewards.mutable_data());
  terminations_ = static_cast<bool*>(terminations.mutable_data());
  truncations_ = static_cast<bool*>(truncations.mutable_data());
  const size_t rows = static_cast<size_t>(first_row_ + num_envs());
  staged_terminations_ = std::make_unique<bool[]>(rows);
  staged_truncations_ = std::make_unique<bool[]>(rows);
  staged_info_flags_ = std::make_unique<uint8_t[]>(rows);
}

// While a lock-step batch steps, its one-byte flags (terminated, truncated,
// info in columns) go to the stepper's own buffers, and into the arena once
// at the end, also when an env raised. Every slice's flags share a few cache
// lines (64 envs' in one), which the other slices' processes write at the
// same time: written in place, each line moved between CPUs at every env.
// NoopEnv x64 on 2 vCPUs that the host ran far apart (a cache line's round
// trip 370-400 ns): 3.75M steps/s in place, 5.76M staged; near (75-130 ns):
// 6.41M and 6.82M (docs/performance.md, "False sharing of the flags").
// Async mode (step_row) publishes each env as it finishes: in place.
class Stepper::FlagStage {
 public:
  explicit FlagStage(Stepper& s)
      : s_(s), terminations_(s.terminations_), truncations_(s.truncations_), info_flags_(s.info_flags_) {
    copy(s_.staged_terminations_.get(), terminations_);
    copy(s_.staged_truncations_.get(), truncations_);
    s_.terminations_ = s_.staged_terminations_.get();
    s_.truncations_ = s_.staged_truncations_.get();
    if (info_flags_) {
      copy(s_.staged_info_flags_.get(), info_flags_);
      s_.info_flags_ = s_.staged_info_flags_.get();
    }
  }
  ~FlagStage() {
    copy(terminations_, s_.terminations_);
    copy(truncations_, s_.truncations_);
    s_.terminations_ = terminations_;
    s_.truncations_ = truncations_;
    if (info_flags_) {
      copy(info_flags_, s_.info_flags_);
      s_.info_flags_ = info_flags_;
    }
  }
  FlagStage(const FlagStage&) = delete;
  FlagStage& operator=(const FlagStage&) = delete;

 private:
  template <typename T>
  void copy(T* to, const T* from) const {
    std::memcpy(to + s_.first_row_, from + s_.first_row_, static_cast<size_t>(s_.num_envs()) * sizeof(T));
  }
  Stepper& s_;
  bool* terminations_;  // the arena's
  bool* truncations_;
  uint8_t* info_flags_;
};

void Stepper::write_leaf(ArrayLeaf& leaf, py::ssize_t row, py::handle value) {
  char* dst = leaf.data + row * leaf.row_bytes;
  PyObject* v = value.ptr();
  // Fast path 1: an array of exactly the leaf's dtype and shape: one memcpy.
  if (py::array::check_(value)) {
    auto a = py::reinterpret_borrow<py::array>(value);
    if (a.ndim() == static_cast<py::ssize_t>(leaf.row_shape.size()) &&
        (a.flags() & py::array::c_style)) {
      bool same_shape = true;
      for (size_t d = 0; d < leaf.row_shape.size(); ++d)
        same_shape = same_shape && a.shape(d) == leaf.row_shape[d];
      if (same_shape && a.dtype().is(leaf.dtype)) {
        std::memcpy(dst, a.data(), leaf.row_bytes);
        return;
      }
      if (same_shape && a.dtype().equal(leaf.dtype)) {
        std::memcpy(dst, a.data(), leaf.row_bytes);
        return;
      }
    }
  } else if (leaf.row_shape.empty()) {
    // Fast path 2: a Python int or float for a scalar leaf (Discrete obs).
    if (PyLong_CheckExact(v) && leaf.kind == 'i' && leaf.itemsize == 8) {
      int overflow = 0;
      long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
      if (!overflow && !(x == -1 && PyErr_Occurred())) {
        int64_t y = x;
        std::memcpy(dst, &y, 8);
        return;
      }
      PyErr_Clear();
    } else if (PyFloat_CheckExact(v) && leaf.kind == 'f' && leaf.itemsize == 8) {
      double d = PyFloat_AS_DOUBLE(v);
      std::memcpy(dst, &d, 8);
      return;
    }
  }
  // Everything else (casts, wrong shapes, scalars of numpy types): Python
  // does what SyncVectorEnv's np.stack would, or raises naming the env.
  call_python(write_fallback_, leaf.batch, py::int_(row), value);
}

py::object Stepper::write_leaves(std::vector<ArrayLeaf*>& targets, py::ssize_t row,
                                 py::handle obs) {
  if (obs_flattener_.is_none()) {
    write_leaf(*targets[0], row, obs);
    return py::none();
  }
  py::object flat = call_python(obs_flattener_, obs);
  py::list values = py::reinterpret_borrow<py::list>(flat);
  if (values.size() != targets.size()) raise_value_error("observation flattener gave the wrong number of leaves");
  py::list objects;
  for (size_t k = 0; k < targets.size(); ++k) {
    if (targets[k])
      write_leaf(*targets[k], row, values[k]);
    else
      objects.append(values[k]);
  }
  if (objects.size() == 0) return py::none();
  return std::move(objects);
}

py::object Stepper::write_observation(py::ssize_t row, py::handle obs) {
  return write_leaves(obs_targets_, row, obs);
}

py::object Stepper::build_action(py::ssize_t row, py::handle objects) {
  if (!action_is_single_leaf_) return call_python(action_builder_, py::int_(row), objects);
  // The batch is stored in the dtype the caller passed it in (the front end
  // wrote the code with the actions, before posting the step).
  // kActionAsPython set: the caller passed Python scalars (or lists of them),
  // which the env gets as SyncVectorEnv hands them on: the row's tolist().
  // kActionAsGiven set: the env gets the caller's own item, which travels
  // beside the arena (the only value in `objects`).
  if (action_codes_[0] & kActionAsGiven) {
    if (objects.is_none()) throw std::runtime_error("an action kept as given did not come with the step");
    return objects[py::int_(0)];
  }
  const std::vector<ArrayLeaf>& views = action_leaves_[0];
  const uint8_t code = action_codes_[0] & ~kActionAsPython;
  const bool as_python = action_codes_[0] & kActionAsPython;
  if (code >= views.size()) throw std::runtime_error("bad action dtype code in the arena");
  const ArrayLeaf& leaf = views[code];
  if (action_leaf_is_row_ && !as_python) {
    // A row of a multi-dimensional leaf: the env gets its own copy, as the
    // arena row is overwritten next step (one new array, no view of the row).
    py::array action = new_array(leaf.dtype, static_cast<int>(leaf.row_shape.size()), leaf.row_shape.data());
    std::memcpy(action.mutable_data(), leaf.data + row * leaf.row_bytes, leaf.row_bytes);
    return std::move(action);
  }
  PyObject* item = PySequence_GetItem(leaf.batch.ptr(), row);
  if (!item) throw py::error_already_set();
  auto action = py::reinterpret_steal<py::object>(item);
  if (as_python) return call_method(action, tolist_name_);
  return action;
}

void Stepper::attach_info_columns(py::array values, py::array flags, py::dict types, py::array schema_slot) {
  if (values.ndim() != 2 || values.shape(0) < first_row_ + num_envs() || values.itemsize() != 8 ||
      !(values.flags() & py::array::c_style) || !values.writeable())
    throw std::invalid_argument("info values must be a writable (num_envs, C) array of 8-byte cells");
  if (flags.ndim() != 1 || flags.shape(0) != values.shape(0) || flags.itemsize() != 1 ||
      !(flags.flags() & py::array::c_style) || !flags.writeable())
    throw std::invalid_argument("info flags must be a writable (num_envs,) uint8 array");
  keep_info_values_ = values;
  keep_info_flags_ = flags;
  info_values_ = static_cast<int64_t*>(values.mutable_data());
  info_flags_ = static_cast<uint8_t*>(flags.mutable_data());
  info_width_ = values.shape(1);
  info_types_ = std::move(types);
  if (schema_slot.ndim() != 1 || schema_slot.itemsize() != 1 || schema_slot.shape(0) < 8 ||
      !(schema_slot.flags() & py::array::c_style) || !schema_slot.writeable())
    throw std::invalid_argument("the info schema slot must be a writable uint8 array of at least 8 bytes");
  keep_schema_slot_ = schema_slot;
  schema_slot_ = static_cast<uint8_t*>(schema_slot.mutable_data());
  schema_slot_size_ = static_cast<size_t>(schema_slot.shape(0));
  pickle_dumps_ = py::module_::import("pickle").attr("dumps");
  // A restarted worker's slice: the dead one's schema is not this stepper's.
  __atomic_store_n(reinterpret_cast<uint32_t*>(schema_slot_), 0u, __ATOMIC_RELEASE);
}

bool Stepper::adopt_schema(py::handle info) {
  const Py_ssize_t n = PyDict_GET_SIZE(info.ptr());
  if (n > info_width_) return false;
  std::vector<InfoColumn> schema;
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(info.ptr(), &pos, &key, &value)) {
    // Keys that VectorEnv._add_info treats specially, or whose mask key
    // could collide with another key, stay on the record path.
    if (!PyUnicode_CheckExact(key) || PyUnicode_GET_LENGTH(key) == 0 ||
        PyUnicode_READ_CHAR(key, 0) == '_' || PyUnicode_CompareWithASCIIString(key, "final_obs") == 0 ||
        PyUnicode_CompareWithASCIIString(key, "final_info") == 0)
      return false;
    PyObject* storage = PyDict_GetItem(info_types_.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(value)));
    if (!storage) return false;
    schema.push_back({py::reinterpret_borrow<py::object>(key),
                      py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(value))),
                      PyObject_IsTrue(storage) == 1});
  }
  // Published before any row uses it: the front end reads it from the
  // arena once a flagged row's step has come back.
  py::list pairs;
  for (const InfoColumn& c : schema) pairs.append(py::make_tuple(c.key, c.type));
  const std::string data = py::bytes(pickle_dumps_(pairs));
  if (data.size() > schema_slot_size_ - sizeof(uint32_t)) return false;
  std::memcpy(schema_slot_ + sizeof(uint32_t), data.data(), data.size());
  __atomic_store_n(reinterpret_cast<uint32_t*>(schema_slot_), static_cast<uint32_t>(data.size()),
                   __ATOMIC_RELEASE);
  schema_ = std::move(schema);
  return true;
}

bool Stepper::store_info(py::ssize_t row, py::handle info) {
  if (!info_flags_) return false;
  info_flags_[row] = 0;
  if (!PyDict_CheckExact(info.ptr()) || PyDict_GET_SIZE(info.ptr()) == 0) return false;
  if (schema_.empty() && !adopt_schema(info)) return false;
  if (PyDict_GET_SIZE(info.ptr()) != static_cast<Py_ssize_t>(schema_.size())) return false;
  int64_t* cells = info_values_ + row * info_width_;
  Py_ssize_t pos = 0, j = 0;
  PyObject *key, *value;
  // Cells are written as we go: a mismatch leaves flag 0, and the front end
  // then ignores the row's cells.
  while (PyDict_Next(info.ptr(), &pos, &key, &value)) {
    const InfoColumn& c = schema_[j++];
    if (key != c.key.ptr()) {  // the same literal key is usually the same object
      int same = PyObject_RichCompareBool(key, c.key.ptr(), Py_EQ);
      if (same != 1) {
        PyErr_Clear();
        return false;
      }
    }
    if (reinterpret_cast<PyObject*>(Py_TYPE(value)) != c.type.ptr()) return false;
    if (c.as_int) {
      int overflow = 0;
      PyObject* index = PyNumber_Index(value);
      long long x = index ? PyLong_AsLongLongAndOverflow(index, &overflow) : -1;
      Py_XDECREF(index);
      if (!index || overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      cells[j - 1] = static_cast<int64_t>(x);
    } else {
      double d = PyFloat_AsDouble(value);
      if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      std::memcpy(&cells[j - 1], &d, sizeof d);
    }
  }
  info_flags_[row] = 1;
  return true;
}

py::object Stepper::step(py::object object_actions) {
  FlagStage stage(*this);
  py::object records = py::none();
  const bool have_objects = !object_actions.is_none();
  for (py::ssize_t k = 0; k < num_envs(); ++k) {
    py::object record =
        step_env(k, have_objects ? py::handle(object_actions[py::int_(k)]) : py::handle(Py_None));
    if (!record.is_none()) {
      if (records.is_none()) records = py::list();
      records.cast<py::list>().append(record);
    }
  }
  return records;
}

py::object Stepper::step_row(py::ssize_t row) {
  if (row < first_row_ || row >= first_row_ + num_envs()) throw py::index_error("row not in this slice");
  return step_env(row - first_row_, py::none());
}

py::object Stepper::step_env(py::ssize_t k, py::handle object_actions) {
  const py::ssize_t row = first_row_ + k;
  failed_row_ = row;
  py::object& env = envs_[k];
  py::object info, final_info, objects, final_obs;

  if (needs_reset_[k] == kRestarted) return restart_report(k);
  if (mode_ == AutoresetMode::next_step && needs_reset_[k] == kAutoreset) {
    py::tuple r = unpack(call_method(env, reset_name_), 2, row, "reset");
    objects = write_leaves(obs_targets_, row, r[0]);
    info = r[1];
    check_info(row, info, "reset");
    rewards_[row] = 0.0;
    terminations_[row] = false;
    truncations_[row] = false;
    needs_reset_[k] = kNone;
  } else {
    py::object action = build_action(row, object_actions);
    py::object result = call_method(env, step_name_, action);
    py::tuple r = unpack(result, 5, row, "step");
    double reward = PyFloat_AsDouble(r[1].ptr());
    if (reward == -1.0 && PyErr_Occurred()) bad_value(row, "reward", r[1], "a number");
    int terminated = PyObject_IsTrue(r[2].ptr());
    if (terminated < 0) bad_value(row, "terminated", r[2], "a bool");
    int truncated = PyObject_IsTrue(r[3].ptr());
    if (truncated < 0) bad_value(row, "truncated", r[3], "a bool");
    rewards_[row] = reward;
    terminations_[row] = terminated;
    truncations_[row] = truncated;
    info = r[4];
    check_info(row, info, "step");
    const bool ended = terminated || truncated;
    if (mode_ == AutoresetMode::same_step && ended) {
      // The terminal observation travels as the env's own object, as
      // SyncVectorEnv hands it over (a Python int stays an int); it costs
      // only at episode ends.
      final_obs = r[0];
      final_info = copy_final_info_arrays_ ? info_arrays_copied(info) : std::move(info);
      py::tuple reset = unpack(call_method(env, reset_name_), 2, row, "reset");
      objects = write_leaves(obs_targets_, row, reset[0]);
      info = reset[1];
      check_info(row, info, "reset");
    } else {
      objects = write_leaves(obs_targets_, row, r[0]);
      needs_reset_[k] = ended ? kAutoreset : kNone;
    }
  }
  failed_row_ = -1;

  const bool has_info = !store_info(row, info) && !is_empty_dict(info);
  const bool ended_same_step = static_cast<bool>(final_info);
  const bool has_objects = objects && !objects.is_none();
  if (!(has_info || ended_same_step || has_objects)) return py::none();
  py::none none;
  // The fields of shmvec._engine.protocol.StepRecord, in order.
  return py::make_tuple(row, has_info ? info : none, ended_same_step,
                        ended_same_step ? final_info : none, has_objects ? objects : none,
                        ended_same_step ? final_obs : none);
}

py::object Stepper::restart_report(py::ssize_t k) {
  const py::ssize_t row = first_row_ + k;
  failed_row_ = row;
  py::dict flag;
  flag[restarted_key_] = true;
  py::object info = flag, final_info = py::none(), objects = py::none();
  if (mode_ == AutoresetMode::same_step) {
    py::tuple r = unpack(call_method(envs_[k], reset_name_), 2, row, "reset");
    objects = write_leaves(obs_targets_, row, r[0]);
    info = PyDict_Check(r[1].ptr()) ? py::dict(py::reinterpret_borrow<py::dict>(r[1])) : py::dict();
    info[restarted_key_] = true;
    final_info = flag;
  }
  rewards_[row] = 0.0;
  terminations_[row] = false;
  truncations_[row] = true;
  needs_reset_[k] = mode_ == AutoresetMode::next_step ? kAutoreset : kNone;
  if (info_flags_) info_flags_[row] = 0;  // its info travels in the record
  failed_row_ = -1;
  const bool ended = !final_info.is_none();
  return py::make_tuple(row, info, ended, final_info, objects.is_none() ? py::object(py::none()) : objects,
                        py::none());
}

}  // namespace shmvec
