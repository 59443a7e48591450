// aitune's per-call checks in one C call each (aitune/torch/check/native_watch.py, NOTE [native watch]).
//
// StateReader(tensors) keeps a reference to each tensor (the Python objects); state() returns (sum of version
// counters, index-weighted sum of data pointers, index-weighted sum of dtype/device codes) over them, the facts
// StateWatch compares per call. Each call unpacks every tensor's current TensorImpl again: a tensor whose TensorImpl
// was swapped (torch.utils.swap_tensors, which nn.Module._apply uses for wrapper subclasses) is
// read as it is now, never through a pointer to the old one. Weighting by position makes two tensors that swapped
// their data differ. Reading the same facts from Python costs an attribute lookup and an int object per tensor.
// all_finite(tensor) is the value gate's nan/inf check of a small CPU input without a torch op and a read of its
// result. call_key(args, kwargs) is the dispatch's route key of a call (NOTE [native call key] in
// aitune/torch/dispatch.py); AttributeReader(dicts, keys, values, sized, sizes).same() is BakedState's per-call
// check that the attributes forward reads are the objects captured (NOTE [native attribute check] in
// aitune/torch/check/baked_state.py). Only CPython's C API and torch's Python tensor unpacking are used: no
// bindings of our own.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <exception>

namespace {

static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion holds one pointer (state's prefetch)");

struct StateReader {
  PyObject_HEAD
  PyObject* tensors;  // a list of the tensors, as given (references kept)
};

// The data pointer is read through TensorImpl's own storage field (unsafe_storage: no virtual call; the constructor
// accepted only tensors whose storage() is that field), which costs ~20 % less than storage() on this project's CPU.
PyObject* reader_state(PyObject* self, PyObject*) {
  PyObject* tensors = reinterpret_cast<StateReader*>(self)->tensors;
  if (tensors == nullptr) {  // (cleared by the collector)
    PyErr_SetString(PyExc_RuntimeError, "StateReader: cleared");
    return nullptr;
  }
  uint64_t versions = 0, pointers = 0, kinds = 0;
  try {
    const Py_ssize_t count = PyList_GET_SIZE(tensors);
    PyObject** items = reinterpret_cast<PyListObject*>(tensors)->ob_item;
    for (Py_ssize_t index = 0; index < count; ++index) {
      // Each tensor is a chain of dependent reads (Python object, TensorImpl, version counter and storage), cache
      // misses where other work (a GPU launch, say) evicted them: the chains of the tensors a few places ahead are
      // prefetched, so that their misses overlap (ResNet-50's 318 tensors, this project's CPU, L2 evicted before
      // each call: 5.4 -> 2.7 µs; warm 2.8 -> 1.9 µs). A prefetch never faults; every real load below is of a
      // field of a live object.
      if (index + 8 < count) __builtin_prefetch(items[index + 8]);
      if (index + 4 < count) {
        const c10::TensorImpl* ahead = THPVariable_Unpack(items[index + 4]).unsafeGetTensorImpl();
        __builtin_prefetch(ahead);
        __builtin_prefetch(reinterpret_cast<const char*>(ahead) + 128);
      }
      if (index + 2 < count) {
        const c10::TensorImpl* ahead = THPVariable_Unpack(items[index + 2]).unsafeGetTensorImpl();
        __builtin_prefetch(ahead->unsafe_storage().unsafeGetStorageImpl());
        void* counter = nullptr;  // (VariableVersion's one member, the counter's intrusive_ptr: its raw pointer)
        std::memcpy(&counter, &ahead->version_counter(), sizeof(counter));
        __builtin_prefetch(counter);
      }
      c10::TensorImpl* impl = THPVariable_Unpack(items[index]).unsafeGetTensorImpl();
      const uint64_t weight = static_cast<uint64_t>(index) + 1;
      if (!impl->is_inference()) {  // (an inference tensor has no version counter; made so after the check below)
        versions += impl->version_counter().current_version();
      }
      const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
      if (storage != nullptr) {
        pointers += weight * (reinterpret_cast<uintptr_t>(storage->data()) +
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

// Both reader types hold Python objects (a module's __dict__ among them, which can reach the reader back through the
// module's own attributes): they take part in the garbage collector's cycle detection.
int reader_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(reinterpret_cast<StateReader*>(self)->tensors);
  return 0;
}

int reader_clear(PyObject* self) {
  Py_CLEAR(reinterpret_cast<StateReader*>(self)->tensors);
  return 0;
}

void reader_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  reader_clear(self);
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
  try {
    for (Py_ssize_t index = 0; index < PyList_GET_SIZE(tensors); ++index) {
      c10::TensorImpl* impl = THPVariable_Unpack(PyList_GET_ITEM(tensors, index)).unsafeGetTensorImpl();
      // state() reads the storage field directly: only where storage() is that field and its data can be read
      if (impl->has_storage()) {
        if (&impl->storage() != &impl->unsafe_storage()) {
          PyErr_Format(PyExc_TypeError, "StateReader: item %zd keeps its storage elsewhere", index);
          Py_DECREF(tensors);
          return nullptr;
        }
        impl->storage().unsafeGetStorageImpl()->data();  // (throws where the data pointer may not be read)
      }
    }
  } catch (const std::exception& error) {
    PyErr_Format(PyExc_TypeError, "StateReader: a tensor's storage cannot be read: %s", error.what());
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

// ---- call_key(args, kwargs): the route key of a call whose arguments are all tensors or plain constants.
// Returns the key, None where an argument is neither (the caller's general path), or NotImplemented where a tensor
// is not a plain strided tensor (a subclass that dispatches to Python, sparse, nested, symbolic sizes): the caller
// then keys the call itself. A key is (len(args), parts): per tensor (scalar type, dim, device type, device index,
// regular) as ints, regular being 1 for a contiguous tensor with elements, per constant (type, value), keyword
// arguments with their name first.
PyObject* tensor_part(PyObject* name, PyObject* item, bool* plain) {
  const at::Tensor& tensor = THPVariable_Unpack(item);
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (impl->is_python_dispatch() || impl->layout() != c10::kStrided || impl->has_symbolic_sizes_strides() ||
      impl->is_nested()) {
    *plain = false;
    return nullptr;
  }
  const c10::Device device = impl->device();
  const long dtype = static_cast<long>(impl->dtype().toScalarType());
  const long dim = static_cast<long>(impl->dim());
  const long type = static_cast<long>(device.type());
  const long index = static_cast<long>(device.index());
  const long regular = impl->numel() != 0 && impl->is_contiguous() ? 1 : 0;
  if (name != nullptr) return Py_BuildValue("(Olllll)", name, dtype, dim, type, index, regular);
  return Py_BuildValue("(lllll)", dtype, dim, type, index, regular);
}

bool plain_constant(PyObject* value) {
  return value == Py_None || PyBool_Check(value) || PyLong_CheckExact(value) || PyFloat_CheckExact(value) ||
         PyUnicode_CheckExact(value);
}

PyObject* call_key(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 2 || !PyTuple_Check(argv[0]) || !PyDict_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "call_key(args: tuple, kwargs: dict)");
    return nullptr;
  }
  PyObject* args = argv[0];
  PyObject* kwargs = argv[1];
  const Py_ssize_t count = PyTuple_GET_SIZE(args);
  PyObject* parts = PyTuple_New(count + PyDict_GET_SIZE(kwargs));
  if (parts == nullptr) return nullptr;
  try {
    Py_ssize_t at = 0;
    bool plain = true;
    auto add = [&](PyObject* name, PyObject* value) -> int {  // 1: added, 0: not flat, -1: error or not plain
      PyObject* part = nullptr;
      if (THPVariable_Check(value)) {
        part = tensor_part(name, value, &plain);
        if (part == nullptr) return -1;
      } else if (plain_constant(value)) {
        PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(value));
        part = name != nullptr ? PyTuple_Pack(3, name, type, value) : PyTuple_Pack(2, type, value);
        if (part == nullptr) return -1;
      } else {
        return 0;
      }
      PyTuple_SET_ITEM(parts, at++, part);
      return 1;
    };
    for (Py_ssize_t index = 0; index < count; ++index) {
      const int added = add(nullptr, PyTuple_GET_ITEM(args, index));
      if (added != 1) {
        Py_DECREF(parts);
        if (added == 0) Py_RETURN_NONE;
        if (!plain) Py_RETURN_NOTIMPLEMENTED;
        return nullptr;
      }
    }
    Py_ssize_t position = 0;
    PyObject *name, *value;
    while (PyDict_Next(kwargs, &position, &name, &value)) {
      const int added = add(name, value);
      if (added != 1) {
        Py_DECREF(parts);
        if (added == 0) Py_RETURN_NONE;
        if (!plain) Py_RETURN_NOTIMPLEMENTED;
        return nullptr;
      }
    }
  } catch (const std::exception& error) {
    Py_DECREF(parts);
    PyErr_Clear();
    Py_RETURN_NOTIMPLEMENTED;  // (whatever torch could not answer: the caller's own reads decide)
  }
  PyObject* key = Py_BuildValue("(nN)", count, parts);
  return key;
}

// ---- AttributeReader(dicts, keys, values, sized, sizes): same() is True while dicts[i][keys[i]] is values[i] for
// every i (identity: no Python code runs) and len(sized[j]) == sizes[j] for every j; False otherwise (a key missing
// included), and the caller then compares by value itself.
struct AttributeReader {
  PyObject_HEAD
  PyObject* dicts;   // list of dict
  PyObject* keys;    // list of str
  PyObject* values;  // list of objects
  PyObject* sized;   // list of dict
  Py_ssize_t* sizes;
};

PyObject* attributes_same(PyObject* self, PyObject*) {
  auto* reader = reinterpret_cast<AttributeReader*>(self);
  if (reader->dicts == nullptr || reader->keys == nullptr || reader->values == nullptr || reader->sized == nullptr) {
    Py_RETURN_FALSE;  // (cleared by the collector)
  }
  const Py_ssize_t count = PyList_GET_SIZE(reader->dicts);
  for (Py_ssize_t index = 0; index < count; ++index) {
    PyObject* now =
        PyDict_GetItemWithError(PyList_GET_ITEM(reader->dicts, index), PyList_GET_ITEM(reader->keys, index));
    if (now != PyList_GET_ITEM(reader->values, index)) {
      if (now == nullptr && PyErr_Occurred()) PyErr_Clear();
      Py_RETURN_FALSE;
    }
  }
  const Py_ssize_t sized = PyList_GET_SIZE(reader->sized);
  for (Py_ssize_t index = 0; index < sized; ++index) {
    if (PyDict_GET_SIZE(PyList_GET_ITEM(reader->sized, index)) != reader->sizes[index]) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

int attributes_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* reader = reinterpret_cast<AttributeReader*>(self);
  Py_VISIT(reader->dicts);
  Py_VISIT(reader->keys);
  Py_VISIT(reader->values);
  Py_VISIT(reader->sized);
  return 0;
}

int attributes_clear(PyObject* self) {
  auto* reader = reinterpret_cast<AttributeReader*>(self);
  Py_CLEAR(reader->dicts);
  Py_CLEAR(reader->keys);
  Py_CLEAR(reader->values);
  Py_CLEAR(reader->sized);
  return 0;
}

void attributes_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  attributes_clear(self);
  PyMem_Free(reinterpret_cast<AttributeReader*>(self)->sizes);
  Py_TYPE(self)->tp_free(self);
}

PyObject* attributes_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *dicts_in, *keys_in, *values_in, *sized_in, *sizes_in;
  if (kwargs != nullptr && PyDict_Size(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "AttributeReader takes no keyword arguments");
    return nullptr;
  }
  if (!PyArg_ParseTuple(args, "OOOOO", &dicts_in, &keys_in, &values_in, &sized_in, &sizes_in)) return nullptr;
  PyObject* lists[4] = {PySequence_List(dicts_in), PySequence_List(keys_in), PySequence_List(values_in),
                        PySequence_List(sized_in)};
  PyObject* sizes = PySequence_List(sizes_in);
  auto fail = [&](const char* message) -> PyObject* {
    if (message != nullptr) PyErr_SetString(PyExc_TypeError, message);
    for (PyObject* list : lists) Py_XDECREF(list);
    Py_XDECREF(sizes);
    return nullptr;
  };
  for (PyObject* list : lists) {
    if (list == nullptr) return fail(nullptr);
  }
  if (sizes == nullptr) return fail(nullptr);
  const Py_ssize_t count = PyList_GET_SIZE(lists[0]);
  if (PyList_GET_SIZE(lists[1]) != count || PyList_GET_SIZE(lists[2]) != count ||
      PyList_GET_SIZE(lists[3]) != PyList_GET_SIZE(sizes)) {
    return fail("AttributeReader: dicts, keys and values (and sized and sizes) must have equal lengths");
  }
  for (Py_ssize_t index = 0; index < count; ++index) {
    if (!PyDict_Check(PyList_GET_ITEM(lists[0], index)) || !PyUnicode_CheckExact(PyList_GET_ITEM(lists[1], index))) {
      return fail("AttributeReader: dicts must be dicts and keys str");
    }
  }
  const Py_ssize_t sized = PyList_GET_SIZE(lists[3]);
  auto* counts = static_cast<Py_ssize_t*>(PyMem_Malloc(sizeof(Py_ssize_t) * (sized > 0 ? sized : 1)));
  if (counts == nullptr) {
    PyErr_NoMemory();
    return fail(nullptr);
  }
  for (Py_ssize_t index = 0; index < sized; ++index) {
    counts[index] = PyLong_AsSsize_t(PyList_GET_ITEM(sizes, index));
    if (!PyDict_Check(PyList_GET_ITEM(lists[3], index)) || (counts[index] == -1 && PyErr_Occurred())) {
      PyMem_Free(counts);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "AttributeReader: sized must be dicts, sizes ints");
      return fail(nullptr);
    }
  }
  Py_DECREF(sizes);
  sizes = nullptr;
  auto* reader = reinterpret_cast<AttributeReader*>(type->tp_alloc(type, 0));
  if (reader == nullptr) {
    PyMem_Free(counts);
    return fail(nullptr);
  }
  reader->dicts = lists[0];
  reader->keys = lists[1];
  reader->values = lists[2];
  reader->sized = lists[3];
  reader->sizes = counts;
  return reinterpret_cast<PyObject*>(reader);
}

PyMethodDef module_methods[] = {
    {"all_finite", all_finite, METH_O,
     "all_finite(tensor) -> True/False for a contiguous CPU float tensor (any nan/inf: False), else None"},
    {"call_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_key)), METH_FASTCALL,
     "call_key(args, kwargs) -> the route key of a flat call, None (nested), NotImplemented (key it yourself)"},
    {nullptr, nullptr, 0, nullptr}};

PyMethodDef reader_methods[] = {
    {"state", reader_state, METH_NOARGS,
     "(sum of version counters, position-weighted sum of data pointers, position-weighted sum of dtype/device "
     "codes) over the tensors, as ints (modulo 2**64)"},
    {nullptr, nullptr, 0, nullptr}};

PyMethodDef attribute_methods[] = {
    {"same", attributes_same, METH_NOARGS,
     "True while every dicts[i][keys[i]] is values[i] and every len(sized[j]) == sizes[j]"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject StateReaderType = {PyVarObject_HEAD_INIT(nullptr, 0) "aitune_native_watch.StateReader"};
PyTypeObject AttributeReaderType = {PyVarObject_HEAD_INIT(nullptr, 0) "aitune_native_watch.AttributeReader"};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aitune_native_watch", nullptr, -1, module_methods};

// A reader type: a garbage-collected object with its constructor, methods and documentation.
int ready_type(PyTypeObject* type, Py_ssize_t size, newfunc make, destructor dealloc, traverseproc traverse,
               inquiry clear, PyMethodDef* methods, const char* doc) {
  type->tp_basicsize = size;
  type->tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  type->tp_traverse = traverse;
  type->tp_clear = clear;
  type->tp_free = PyObject_GC_Del;
  type->tp_new = make;
  type->tp_dealloc = dealloc;
  type->tp_methods = methods;
  type->tp_doc = doc;
  return PyType_Ready(type);
}

int add_type(PyObject* module, const char* name, PyTypeObject* type) {
  Py_INCREF(type);
  if (PyModule_AddObject(module, name, reinterpret_cast<PyObject*>(type)) < 0) {
    Py_DECREF(type);
    return -1;
  }
  return 0;
}

}  // namespace

PyMODINIT_FUNC PyInit_aitune_native_watch() {
  if (ready_type(&StateReaderType, sizeof(StateReader), reader_new, reader_dealloc, reader_traverse, reader_clear,
                 reader_methods, "StateReader(tensors): state() of a fixed list of tensors in one call") < 0 ||
      ready_type(&AttributeReaderType, sizeof(AttributeReader), attributes_new, attributes_dealloc,
                 attributes_traverse, attributes_clear, attribute_methods,
                 "AttributeReader(dicts, keys, values, sized, sizes): same() by identity in one call") < 0) {
    return nullptr;
  }
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  if (add_type(module, "StateReader", &StateReaderType) < 0 ||
      add_type(module, "AttributeReader", &AttributeReaderType) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
