// The front end's side of the info columns (the stepper writes them): a
// step's cells read into the dict VectorEnv._add_info builds, in one call,
// so that infos cost no per-key numpy calls on the step path.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace shmvec {

namespace py = pybind11;

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
