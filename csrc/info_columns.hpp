// The front end's side of the info columns (the stepper writes them): a
// step's cells read into the dict VectorEnv._add_info builds, in one call,
// so that infos cost no per-key numpy calls on the step path.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace shmvec {

namespace py = pybind11;

// The bytes of `flags` (below), checked: std::invalid_argument naming `what`
// unless it is a C-contiguous 1-d array of one-byte items, `num_envs` long
// (any length when num_envs < 0).
inline const uint8_t* info_flag_bytes(const py::array& flags, py::ssize_t num_envs, const char* what) {
  if (flags.ndim() != 1 || flags.itemsize() != 1 || !(flags.flags() & py::array::c_style) ||
      (num_envs >= 0 && flags.shape(0) != num_envs))
    throw std::invalid_argument(std::string(what) + ": info flags must be a (num_envs,) uint8 array");
  return static_cast<const uint8_t*>(flags.data());
}

// `flags`: (num_envs,) uint8, 1 where the row's info is in its cells, else 0.
// `columns`: one tuple per key of the schema, (key, mask_key, cells, dtype),
// where cells is the key's column of the (num_envs, C) cells, a 1-d view as
// int64 or float64. `rows`: None for every env in order, or the env rows
// of a batch (an int array; async mode), item i of the result being row
// rows[i]. For each column, in order: key -> an array of `dtype` (the cells
// cast as astype casts them, 0 where the flag is 0) and mask_key -> a bool
// array of the flags, each array its own. {} when no flag is set.
py::dict info_batch(const py::array& flags, const py::list& columns, const py::object& rows);

}  // namespace shmvec
