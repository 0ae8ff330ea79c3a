#include "info_columns.hpp"
#include "new_arrays.hpp"
#include "row_array.hpp"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace shmvec {

namespace {

// Which rows of the cells make the batch: rows[i] for item i, or item i
// itself when rows is null (every env, in order).
struct Rows {
  const int64_t* rows;
  py::ssize_t operator[](py::ssize_t i) const { return rows ? rows[i] : i; }
};

// Fills `out` (n items of To) from the strided cells of `rows`, 0 where absent.
template <typename From, typename To>
void fill(char* out, const char* cells, py::ssize_t stride, const uint8_t* present, Rows rows, py::ssize_t n) {
  To* target = reinterpret_cast<To*>(out);
  for (py::ssize_t i = 0; i < n; ++i) {
    From v;
    std::memcpy(&v, cells + rows[i] * stride, sizeof v);
    if constexpr (std::is_same_v<To, bool>)
      target[i] = present[i] && v != 0;
    else
      target[i] = present[i] ? static_cast<To>(v) : To{0};
  }
}

// Fills `out` for a dtype (kind, itemsize) cast here; false for the rest
// (float16, ...), which numpy casts.
template <typename From>
bool fill_as(char kind, py::ssize_t size, char* out, const char* cells, py::ssize_t stride,
             const uint8_t* present, Rows rows, py::ssize_t n) {
  if (kind == 'f' && size == 8) fill<From, double>(out, cells, stride, present, rows, n);
  else if (kind == 'f' && size == 4) fill<From, float>(out, cells, stride, present, rows, n);
  else if (kind == 'i' && size == 8) fill<From, int64_t>(out, cells, stride, present, rows, n);
  else if (kind == 'i' && size == 4) fill<From, int32_t>(out, cells, stride, present, rows, n);
  else if (kind == 'i' && size == 2) fill<From, int16_t>(out, cells, stride, present, rows, n);
  else if (kind == 'i' && size == 1) fill<From, int8_t>(out, cells, stride, present, rows, n);
  else if (kind == 'u' && size == 4) fill<From, uint32_t>(out, cells, stride, present, rows, n);
  else if (kind == 'u' && size == 2) fill<From, uint16_t>(out, cells, stride, present, rows, n);
  else if (kind == 'u' && size == 1) fill<From, uint8_t>(out, cells, stride, present, rows, n);
  else if (kind == 'b' && size == 1) fill<From, bool>(out, cells, stride, present, rows, n);
  else return false;
  return true;
}

py::array empty(const py::dtype& dtype, py::ssize_t n) { return new_array(dtype, 1, &n); }

}  // namespace

py::dict info_batch(const py::array& flags, const py::list& columns, const py::object& rows_or_none) {
  const uint8_t* all_flags = info_flag_bytes(flags, -1, "info_batch");
  const py::ssize_t num_envs = flags.shape(0);
  // 0 or 1 per item (the stepper writes nothing else): also the bytes of
  // each bool mask.
  const uint8_t* present = all_flags;
  py::ssize_t n = num_envs;
  Rows rows{nullptr};
  RowArray row_array;
  std::vector<uint8_t> gathered;
  if (!rows_or_none.is_none()) {
    row_array = RowArray::ensure(rows_or_none);
    if (!row_array) throw std::invalid_argument("info rows must be a 1-d int array");
    check_rows_1d(row_array, "info rows must be a 1-d int array");
    n = row_array.shape(0);
    rows.rows = row_array.data();
    gathered.resize(static_cast<std::size_t>(n));
    for (py::ssize_t i = 0; i < n; ++i) {
      if (rows[i] < 0 || rows[i] >= num_envs) throw py::index_error("info row out of range");
      gathered[i] = all_flags[rows[i]];
    }
    present = gathered.data();
  }
  py::dict out;
  if (n == 0 || std::memchr(present, 1, static_cast<std::size_t>(n)) == nullptr)
    return out;  // no env returned an info: {} as _add_info leaves it
  const py::dtype bool_dtype = py::dtype::of<bool>();
  for (py::handle item : columns) {
    if (!PyTuple_Check(item.ptr()) || PyTuple_GET_SIZE(item.ptr()) != 4)
      throw std::invalid_argument("an info column is (key, mask_key, cells, dtype)");
    PyObject* key = PyTuple_GET_ITEM(item.ptr(), 0);
    PyObject* mask_key = PyTuple_GET_ITEM(item.ptr(), 1);
    auto cells = py::reinterpret_borrow<py::array>(PyTuple_GET_ITEM(item.ptr(), 2));
    auto dtype = py::reinterpret_borrow<py::dtype>(PyTuple_GET_ITEM(item.ptr(), 3));
    const char cell_kind = cells.dtype().kind();
    if (cells.ndim() != 1 || cells.shape(0) != num_envs || cells.itemsize() != 8 ||
        (cell_kind != 'i' && cell_kind != 'f'))
      throw std::invalid_argument("info cells must be a (num_envs,) int64 or float64 view");
    const char* data = static_cast<const char*>(cells.data());
    const py::ssize_t stride = cells.strides(0);
    const bool as_float = cell_kind == 'f';
    py::array values = empty(dtype, n);
    char* target = static_cast<char*>(values.mutable_data());
    const char kind = dtype.kind();
    const py::ssize_t size = dtype.itemsize();
    const bool done = as_float ? fill_as<double>(kind, size, target, data, stride, present, rows, n)
                               : fill_as<int64_t>(kind, size, target, data, stride, present, rows, n);
    if (!done) {  // a rarer dtype (float16): numpy casts, as _add_info's array does
      py::array wide = empty(cells.dtype(), n);
      char* w = static_cast<char*>(wide.mutable_data());
      if (as_float) fill<double, double>(w, data, stride, present, rows, n);
      else fill<int64_t, int64_t>(w, data, stride, present, rows, n);
      values = wide.attr("astype")(dtype);
    }
    py::array mask = empty(bool_dtype, n);
    std::memcpy(mask.mutable_data(), present, static_cast<std::size_t>(n));
    if (PyDict_SetItem(out.ptr(), key, values.ptr()) != 0 ||
        PyDict_SetItem(out.ptr(), mask_key, mask.ptr()) != 0)
      throw py::error_already_set();
  }
  return out;
}

}  // namespace shmvec
