// New numpy arrays straight through numpy's C API. On the step path
// py::array's constructors cost more than they should: they allocate shape
// and stride vectors for every array. (And py::array(dtype, {n}) would pick
// a deprecated constructor that wraps `dtype` itself.)
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace shmvec {

namespace py = pybind11;

// A new C-contiguous array of `dtype` and `shape` (ndim entries), uninitialized.
inline py::array new_array(const py::dtype& dtype, int ndim, const py::ssize_t* shape) {
  auto& api = py::detail::npy_api::get();
  auto* dims = reinterpret_cast<Py_intptr_t*>(const_cast<py::ssize_t*>(shape));  // (numpy only reads it)
  PyObject* array = api.PyArray_NewFromDescr_(api.PyArray_Type_, dtype.inc_ref().ptr(),  // (steals the dtype)
                                              ndim, dims, nullptr, nullptr, 0, nullptr);
  if (!array) throw py::error_already_set();
  return py::reinterpret_steal<py::array>(array);
}

}  // namespace shmvec
