// Env rows as the front end hands them to the native core: an int64 array
// (the ids it already holds; a list is converted by numpy), read without a
// Python object per row.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>

namespace shmvec {

namespace py = pybind11;

using RowArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Throws std::invalid_argument (Python's ValueError) with `message` unless
// `rows` is one-dimensional.
inline void check_rows_1d(const RowArray& rows, const char* message = "env rows must be 1-D") {
  if (rows.ndim() != 1) throw std::invalid_argument(message);
}

}  // namespace shmvec
