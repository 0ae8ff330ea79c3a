// Calls from native code into Python code, for threads that may be ended
// mid-call.
//
// Up to Python 3.13, CPython ends a thread that takes the GIL back while the
// interpreter finalizes (a daemon thread mid-step at exit: its Python code
// gives the GIL up every few milliseconds) with pthread_exit. glibc's
// pthread_exit unwinds the stack like an exception, running the destructors
// of the Python references on the native frames without the GIL: a bound
// method freed so, while the main thread's garbage collector walked its
// lists, crashed the program at exit (SIGSEGV, its exit status lost). So
// native code calls Python only through these helpers, which stop that
// unwinding at once: the thread parks, holding nothing, until the process
// ends, as CPython 3.14 parks such threads. Only raw C-API calls run inside
// the guard, so no destructor runs before it.
#pragma once

#include <pybind11/pybind11.h>
#include <unistd.h>

#if defined(__GLIBCXX__)
#include <cxxabi.h>
#endif

namespace shmvec {

namespace py = pybind11;

// Runs `call`, which may only use raw pointers (nothing in it owns a
// reference), and parks the thread instead of letting pthread_exit unwind
// past this frame.
template <class Call>
auto guarding_thread_exit(Call&& call) -> decltype(call()) {
#if defined(__GLIBCXX__)
  try {
    return call();
  } catch (abi::__forced_unwind&) {
    // Never leaves this handler: glibc aborts if its unwinding is caught
    // and not rethrown, and rethrowing is the crash this prevents.
    for (;;) pause();
  }
#else
  return call();
#endif
}

inline py::object checked_result(PyObject* result) {
  if (!result) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

// fn(args...), args being py::handle or py::object.
template <class... Args>
py::object call_python(py::handle fn, const Args&... args) {
  // One slot before the arguments lets CPython prepend `self` without a copy.
  PyObject* argv[] = {nullptr, py::handle(args).ptr()...};
  return checked_result(guarding_thread_exit([&] {
    return PyObject_Vectorcall(fn.ptr(), argv + 1, sizeof...(Args) | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  }));
}

// fn(*args).
inline py::object call_python_with(py::handle fn, py::handle args_tuple) {
  return checked_result(guarding_thread_exit([&] { return PyObject_Call(fn.ptr(), args_tuple.ptr(), nullptr); }));
}

// obj.name(args...), name a str.
template <class... Args>
py::object call_method(py::handle obj, py::handle name, const Args&... args) {
  PyObject* argv[] = {nullptr, obj.ptr(), py::handle(args).ptr()...};
  return checked_result(guarding_thread_exit([&] {
    return PyObject_VectorcallMethod(name.ptr(), argv + 1, (sizeof...(Args) + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     nullptr);
  }));
}

// PyEval_RestoreThread, the other point where CPython ends such a thread.
inline void restore_thread(PyThreadState* tstate) {
  guarding_thread_exit([&] {
    PyEval_RestoreThread(tstate);
    return 0;
  });
}

}  // namespace shmvec
