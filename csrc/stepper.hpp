// The per-env work of a step, in native code: read the action row, call
// env.step, write every observation leaf, the reward and the flags into the
// arena, autoreset. Runs with the GIL held (it calls Python envs); the same
// code serves worker processes and a caller that steps a slice itself.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <vector>

namespace shmvec {

namespace py = pybind11;

enum class AutoresetMode { next_step = 0, same_step = 1, disabled = 2 };
// Set on the autoreset code where an ended episode's info is batched before
// the env's reset, as Gymnasium 1.1+'s SAME_STEP does (copying the arrays it
// holds); 0.29's same-step autoreset keeps the info itself.
constexpr int kCopyFinalInfoArrays = 0x10;

// One fixed-shape leaf of a space: a (num_envs, *shape) array in the arena.
struct ArrayLeaf {
  py::array batch;
  char* data = nullptr;
  py::ssize_t row_bytes = 0;
  std::vector<py::ssize_t> row_shape;
  py::dtype dtype;
  char kind = 0;  // numpy dtype kind: 'f', 'i', 'u', 'b'
  py::ssize_t itemsize = 0;
};

// Raises TypeError naming env `row` unless `info` (returned by its `call`,
// "step" or "reset") is a dict, or a mapping VectorEnv._add_info can read:
// None would otherwise pass for "no info".
void check_info(py::ssize_t row, py::handle info, const char* call);

class Stepper {
 public:
  // envs: this slice's envs, rows first_row .. first_row + len(envs) - 1.
  // *_leaves: one entry per leaf of the space, an arena array or None for a
  // leaf without a fixed shape (it travels by pickle in the records). An
  // action leaf is a list of arrays instead, views of the same bytes in
  // each dtype the batch may be stored in; action_codes (uint8, one per
  // action leaf) says which one holds the current batch, and its high bit
  // that each env gets its element as Python values (tolist()).
  // action_builder(row, objects) builds a structured action; None when the
  // action space is one fixed leaf. obs_flattener(obs) lists an observation's
  // leaves; None when the observation space is one fixed leaf.
  // write_fallback(target, row, value) writes what the fast paths do not
  // handle (casts, validation, errors that name the env).
  Stepper(py::list envs, py::ssize_t first_row, py::list action_leaves, py::array action_codes,
          py::object action_builder,
          py::list obs_leaves, py::object obs_flattener,
          py::array rewards, py::array terminations, py::array truncations, int autoreset_mode,
          py::object write_fallback);

  // Steps every env of the slice (lock-step). `object_actions` is None, or a
  // list (one per env) of the action's non-fixed leaves. Returns None when
  // nothing but arrays came out, else a list of records, in row order:
  //   (row, info or None, ended, final_info, objects or None, final_obs)
  // `ended` is true when a SAME_STEP episode ended (final_info is then the
  // terminal step's info). A restart report (see mark_restarted) under
  // SAME_STEP has final_obs None: the front end holds the last observation
  // it handed out. Raises the env's own exception; failed_row says where.
  py::object step(py::object object_actions);
  // Steps one env of the slice (async mode: a worker, or the caller for its
  // own slice); returns its record or None.
  py::object step_row(py::ssize_t row);

  // Writes an observation of env `row` (e.g. after an explicit reset) and
  // returns its non-fixed leaves (a list) or None.
  py::object write_observation(py::ssize_t row, py::handle obs);
  // After an explicit reset the env is no longer waiting for an autoreset,
  // and its info (which travels in the reset's record) is not in columns.
  void reset_done(py::ssize_t row) {
    needs_reset_.at(row - first_row_) = kNone;
    if (info_flags_) info_flags_[row] = 0;
  }
  // The env was rebuilt after its process died: its next step, whatever the
  // action, reports the episode cut short as the autoreset mode reports any
  // truncation. Reward 0, truncated, info {"shmvec_restarted": True}; the
  // observation is left as it is (the front end wrote the last one it handed
  // out) under NEXT_STEP, which then autoresets on the step after, and
  // DISABLED, where the caller resets it; SAME_STEP resets it at once.
  void mark_restarted(py::ssize_t row) { needs_reset_.at(row - first_row_) = kRestarted; }

  // Infos as columns: `values` is a (num_envs, C) int64 array
  // whose 8-byte cells hold doubles or int64s, `flags` a (num_envs,) uint8
  // array, `types` a dict {value type: 0 (stored as double) or 1 (int64)}.
  // The first step info whose keys are strings and whose values all have a
  // type in `types` becomes the slice's schema; from then on every info with
  // the same keys, in the same order, with values of the same types, is
  // written into its row's cells (flag 1) instead of travelling by pickle in
  // a record. Anything else still goes in the record (flag 0).
  // `schema_slot`, the slice's uint8 area of the arena, publishes the
  // schema when it is adopted: a uint32 length, then pickle.dumps of
  // [(key, type), ...] (length 0: none yet), so that the front end reads a
  // row's infos without asking this process, which may have died since.
  // A schema too long for the slot is not adopted (its infos go in records).
  void attach_info_columns(py::array values, py::array flags, py::dict types, py::array schema_slot);

  py::ssize_t first_row() const { return first_row_; }
  py::ssize_t num_envs() const { return static_cast<py::ssize_t>(envs_.size()); }
  py::ssize_t failed_row() const { return failed_row_; }

 private:
  py::object step_env(py::ssize_t k, py::handle object_actions);
  py::object build_action(py::ssize_t row, py::handle objects);
  // Returns the list of non-fixed leaves (or None) after writing fixed ones.
  py::object write_leaves(std::vector<ArrayLeaf*>& targets, py::ssize_t row, py::handle obs);
  void write_leaf(ArrayLeaf& leaf, py::ssize_t row, py::handle value);
  // Writes `info` into the row's info cells if it fits the schema (adopting
  // one if there is none yet); false if it must travel in a record.
  bool store_info(py::ssize_t row, py::handle info);
  bool adopt_schema(py::handle info);

  struct InfoColumn {
    py::object key, type;
    bool as_int;
  };

  std::vector<py::object> envs_;
  py::ssize_t first_row_;
  // Per action leaf, its views by dtype code (empty: no fixed shape).
  std::vector<std::vector<ArrayLeaf>> action_leaves_;
  const uint8_t* action_codes_;  // the front end's, per leaf, written before each step
  py::array keep_action_codes_;
  bool action_is_single_leaf_;
  bool action_leaf_is_row_;  // the leaf has a shape, so a row view must be copied
  py::object action_builder_;
  std::vector<ArrayLeaf> obs_leaves_;
  std::vector<ArrayLeaf*> obs_targets_;  // nullptr = non-fixed leaf
  py::object obs_flattener_;
  double* rewards_;
  bool* terminations_;
  bool* truncations_;
  AutoresetMode mode_;
  bool copy_final_info_arrays_;
  py::object write_fallback_;
  enum : uint8_t { kNone = 0, kAutoreset = 1, kRestarted = 2 };
  py::object restart_report(py::ssize_t k);
  std::vector<uint8_t> needs_reset_;  // per env: kNone, kAutoreset or kRestarted
  py::ssize_t failed_row_ = -1;
  py::str step_name_, reset_name_, tolist_name_, restarted_key_;
  py::array keep_rewards_, keep_terminations_, keep_truncations_;
  // Info columns; info_flags_ is null until they are attached.
  py::array keep_info_values_, keep_info_flags_;
  int64_t* info_values_ = nullptr;
  uint8_t* info_flags_ = nullptr;
  py::ssize_t info_width_ = 0;
  py::dict info_types_;
  std::vector<InfoColumn> schema_;
  py::array keep_schema_slot_;
  uint8_t* schema_slot_ = nullptr;
  size_t schema_slot_size_ = 0;
  py::object pickle_dumps_;
  // step() stages the slice's one-byte flags here, indexed by row as the
  // arena's are (see FlagStage in stepper.cpp).
  class FlagStage;
  std::unique_ptr<bool[]> staged_terminations_, staged_truncations_;
  std::unique_ptr<uint8_t[]> staged_info_flags_;
};

}  // namespace shmvec
