// aitune's per-call checks in one C call each (aitune/torch/check/native_watch.py, NOTE [native watch]).
//
// StateReader(tensors) keeps a reference to each tensor (the Python objects); state() returns
// (sum of version counters, index-weighted sum of data pointers, index-weighted sum of dtype/device codes) over
// them, the facts StateWatch compares per call. Each call unpacks every tensor's current TensorImpl again: a tensor
// whose TensorImpl was swapped (torch.utils.swap_tensors, which nn.Module._apply uses for wrapper subclasses) is
// read as it is now, never through a pointer to the old one. Weighting by position makes two tensors that swapped
// their data differ. Reading the same facts from Python costs an attribute lookup and an int object per tensor.
// all_finite(tensor) is the value gate's nan/inf check of a small CPU input without a torch op and a read of its
// result. Only CPython's C API and torch's Python tensor unpacking are used: no bindings of our own.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <exception>

namespace {

struct StateReader {
  PyObject_HEAD
  PyObject* tensors;  // a list of the tensors, as given (references kept)
};

PyObject* reader_state(PyObject* self, PyObject*) {
  PyObject* tensors = reinterpret_cast<StateReader*>(self)->tensors;
  uint64_t versions = 0, pointers = 0, kinds = 0;
  try {
    const Py_ssize_t count = PyList_GET_SIZE(tensors);
    for (Py_ssize_t index = 0; index < count; ++index) {
      c10::TensorImpl* impl = THPVariable_Unpack(PyList_GET_ITEM(tensors, index)).unsafeGetTensorImpl();
      const uint64_t weight = static_cast<uint64_t>(index) + 1;
      if (!impl->is_inference()) {  // (an inference tensor has no version counter; made so after the check below)
        versions += impl->version_counter().current_version();
      }
      if (impl->has_storage()) {
        pointers += weight * (reinterpret_cast<uintptr_t>(impl->storage().data()) +
                              static_cast<uint64_t>(impl->storage_offset()) * impl->itemsize());
      }
      const c10::Device device = impl->device();
      kinds += weight * (static_cast<uint64_t>(impl->dtype().toScalarType()) * 1000003u +
                         static_cast<uint64_t>(device.type()) * 1009u + static_cast<uint64_t>(device.index() + 1));
    }
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  return Py_BuildValue("(KKK)", static_cast<unsigned long long>(versions), static_cast<unsigned long long>(pointers),
                       static_cast<unsigned long long>(kinds));
}

void reader_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<StateReader*>(self)->tensors);
  Py_TYPE(self)->tp_free(self);
}

PyObject* reader_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject* given = nullptr;
  if (kwargs != nullptr && PyDict_Size(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "StateReader(tensors) takes no keyword arguments");
    return nullptr;
  }
  if (!PyArg_ParseTuple(args, "O", &given)) return nullptr;
  PyObject* tensors = PySequence_List(given);
  if (tensors == nullptr) return nullptr;
  try {
    for (Py_ssize_t index = 0; index < PyList_GET_SIZE(tensors); ++index) {
      PyObject* item = PyList_GET_ITEM(tensors, index);
      if (!THPVariable_Check(item)) {
        PyErr_Format(PyExc_TypeError, "StateReader: item %zd is not a tensor", index);
        Py_DECREF(tensors);
        return nullptr;
      }
      if (THPVariable_Unpack(item).unsafeGetTensorImpl()->is_inference()) {
        PyErr_Format(PyExc_TypeError, "StateReader: item %zd is an inference tensor (no version counter)", index);
        Py_DECREF(tensors);
        return nullptr;
      }
    }
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    Py_DECREF(tensors);
    return nullptr;
  }
  auto* reader = reinterpret_cast<StateReader*>(type->tp_alloc(type, 0));
  if (reader == nullptr) {
    Py_DECREF(tensors);
    return nullptr;
  }
  reader->tensors = tensors;
  return reinterpret_cast<PyObject*>(reader);
}

// Does a contiguous CPU tensor of a floating dtype hold only finite values? An element is nan or inf exactly when
// its exponent bits are all ones (IEEE 754; bfloat16 keeps float32's exponent): a test on integer bits, with no
// reduction in floating point that could overflow.
template <typename Bits>
bool exponents_all_ones_anywhere(const void* data, int64_t count, Bits mask) {
  const Bits* bits = static_cast<const Bits*>(data);
  Bits found = 0;
  for (int64_t index = 0; index < count; ++index) found |= static_cast<Bits>((bits[index] & mask) == mask);
  return found != 0;
}

PyObject* all_finite(PyObject*, PyObject* item) {
  try {
    if (!THPVariable_Check(item)) {
      PyErr_SetString(PyExc_TypeError, "all_finite(tensor): not a tensor");
      return nullptr;
    }
    c10::TensorImpl* impl = THPVariable_Unpack(item).unsafeGetTensorImpl();
    if (impl->device_type() != c10::DeviceType::CPU || impl->is_python_dispatch() || !impl->has_storage() ||
        !impl->is_contiguous() || impl->is_conj() || impl->is_neg()) {
      Py_RETURN_NONE;
    }
    const int64_t count = impl->numel();
    const void* data = count > 0 ? impl->data() : nullptr;
    if (count > 0 && data == nullptr) Py_RETURN_NONE;
    bool non_finite = false;
    switch (impl->dtype().toScalarType()) {
      case c10::ScalarType::Float:
        non_finite = exponents_all_ones_anywhere<uint32_t>(data, count, 0x7f800000u);
        break;
      case c10::ScalarType::Double:
        non_finite = exponents_all_ones_anywhere<uint64_t>(data, count, 0x7ff0000000000000ull);
        break;
      case c10::ScalarType::Half:
        non_finite = exponents_all_ones_anywhere<uint16_t>(data, count, 0x7c00u);
        break;
      case c10::ScalarType::BFloat16:
        non_finite = exponents_all_ones_anywhere<uint16_t>(data, count, 0x7f80u);
        break;
      default:
        Py_RETURN_NONE;
    }
    if (non_finite) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}

PyMethodDef module_methods[] = {
    {"all_finite", all_finite, METH_O,
     "all_finite(tensor) -> True/False for a contiguous CPU float tensor (any nan/inf: False), else None"},
    {nullptr, nullptr, 0, nullptr}};

PyMethodDef reader_methods[] = {
    {"state", reader_state, METH_NOARGS,
     "(sum of version counters, position-weighted sum of data pointers, position-weighted sum of dtype/device "
     "codes) over the tensors, as ints (modulo 2**64)"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject StateReaderType = {PyVarObject_HEAD_INIT(nullptr, 0) "aitune_native_watch.StateReader"};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aitune_native_watch", nullptr, -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_aitune_native_watch() {
  StateReaderType.tp_basicsize = sizeof(StateReader);
  StateReaderType.tp_flags = Py_TPFLAGS_DEFAULT;
  StateReaderType.tp_new = reader_new;
  StateReaderType.tp_dealloc = reader_dealloc;
  StateReaderType.tp_methods = reader_methods;
  StateReaderType.tp_doc = "StateReader(tensors): state() of a fixed list of tensors in one call";
  if (PyType_Ready(&StateReaderType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(&StateReaderType);
  if (PyModule_AddObject(module, "StateReader", reinterpret_cast<PyObject*>(&StateReaderType)) < 0) {
    Py_DECREF(&StateReaderType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
