/* The steps of reading DCP's `.metadata` safely (dcp_allow_list.py) that run once per record
 * or value, in C: a 16,000-entry file holds about half a million records, and in Python these
 * steps cost nearly as much as the unpickling itself (docs/scale.md). Optional: where this
 * module is not built, dcp_allow_list.py does the same in Python, and the tests run every
 * crafted pickle through both (tests/integrity/conftest.py).
 *
 * - `RecordBase`: the base of a record maker. NEWOBJ (and INST or OBJ without arguments)
 *   calls its `tp_new`, which makes a bare record of the DCP class `bind` gave the maker, by
 *   `object.__new__` alone: no code of DCP's or the pickle's runs, and the arguments are
 *   ignored, as `object.__new__` ignores them. Calling a maker, or setting anything on it, is
 *   refused by its Python metaclass (`RecordMaker`), not here.
 * - `check_records`: whether every record is of exactly one class, holds only the given
 *   fields (each present unless optional) and each value is of exactly one of its field's
 *   kinds. It only reads: it calls nothing of the records, and answers None wherever anything
 *   differs, so that the Python check decides and names the problem.
 * - `plain`: whether `planner_data` is plain data within its budget; on False the Python walk
 *   names the problem.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *bound;   /* maker type -> DCP's record class; never shrinks */
static PyObject *no_args; /* () */

static PyObject *
record_new(PyTypeObject *maker, PyObject *args, PyObject *kwargs)
{
    PyObject *record = PyDict_GetItemWithError(bound, (PyObject *)maker); /* borrowed */
    if (record == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s is not bound to a record class", maker->tp_name);
        return NULL;
    }
    return PyBaseObject_Type.tp_new((PyTypeObject *)record, no_args, NULL);
}

static PyTypeObject RecordBase = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "trainckpt.format.safe_unpickle.fast_records.RecordBase",
    .tp_doc = "The base of a record maker: NEWOBJ on a maker makes a bare record (bind).",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = record_new,
};

/* bind(maker, record): NEWOBJ on `maker` (a subclass of RecordBase) makes a bare `record`. */
static PyObject *
bind(PyObject *module, PyObject *args)
{
    PyObject *maker, *record;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &maker, &PyType_Type, &record))
        return NULL;
    if (maker == (PyObject *)&RecordBase ||
        !PyType_IsSubtype((PyTypeObject *)maker, &RecordBase)) {
        PyErr_SetString(PyExc_TypeError, "bind: the maker must be a subclass of RecordBase");
        return NULL;
    }
    if (PyDict_GetItemWithError(bound, maker) != NULL || PyErr_Occurred()) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bind: this maker is bound already");
        return NULL;
    }
    if (PyDict_SetItem(bound, maker, record) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* check_records(records, cls, names, kinds, optional, keep) -> a tuple of lists, or None.
 *
 * `records` is a list; `names`, `kinds`, `optional` and `keep` are tuples of one item per
 * field: its name (str), the frozenset of the exact types its values may have (or None: any),
 * whether a record may lack it (bool), and whether to return its values (bool). The answer
 * holds, per field, the list of its values if kept (else an empty list), or is None if a
 * record is not exactly of `cls`, lacks a field that is not optional, holds a key that is not
 * a field, or holds a value of another type. */
static PyObject *
check_records(PyObject *module, PyObject *args)
{
    PyObject *records, *cls, *names, *kinds, *optional, *keep;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!", &PyList_Type, &records, &PyType_Type, &cls,
                          &PyTuple_Type, &names, &PyTuple_Type, &kinds, &PyTuple_Type,
                          &optional, &PyTuple_Type, &keep))
        return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(names);
    if (PyTuple_GET_SIZE(kinds) != k || PyTuple_GET_SIZE(optional) != k ||
        PyTuple_GET_SIZE(keep) != k) {
        PyErr_SetString(PyExc_ValueError, "check_records: one name, kinds, optional, keep per field");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *ks = PyTuple_GET_ITEM(kinds, j);
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(names, j)) ||
            (ks != Py_None && !PyFrozenSet_CheckExact(ks)) ||
            !PyBool_Check(PyTuple_GET_ITEM(optional, j)) ||
            !PyBool_Check(PyTuple_GET_ITEM(keep, j))) {
            PyErr_SetString(PyExc_TypeError, "check_records: a field's name, kinds, optional or keep");
            return NULL;
        }
    }
    PyObject *out = PyTuple_New(k);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *column = PyList_New(0);
        if (column == NULL)
            goto error;
        PyTuple_SET_ITEM(out, j, column);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        PyObject *record = PyList_GET_ITEM(records, i); /* borrowed: `records` is not changed */
        if ((PyObject *)Py_TYPE(record) != cls)
            goto differs;
        PyObject *fields = PyObject_GenericGetDict(record, NULL);
        if (fields == NULL)
            goto error;
        if (!PyDict_CheckExact(fields)) {
            Py_DECREF(fields);
            goto differs;
        }
        Py_ssize_t held = 0;
        int alike = 1;
        for (Py_ssize_t j = 0; j < k && alike; j++) {
            PyObject *value = PyDict_GetItemWithError(fields, PyTuple_GET_ITEM(names, j));
            if (value == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(fields);
                    goto error;
                }
                alike = PyTuple_GET_ITEM(optional, j) == Py_True;
                continue;
            }
            held++;
            PyObject *ks = PyTuple_GET_ITEM(kinds, j);
            if (ks != Py_None) {
                int in = PySet_Contains(ks, (PyObject *)Py_TYPE(value));
                if (in < 0) {
                    Py_DECREF(fields);
                    goto error;
                }
                alike = in;
            }
            if (alike && PyTuple_GET_ITEM(keep, j) == Py_True &&
                PyList_Append(PyTuple_GET_ITEM(out, j), value) < 0) {
                Py_DECREF(fields);
                goto error;
            }
        }
        /* a record's keys are distinct: they are all fields iff the counts agree */
        alike = alike && PyDict_GET_SIZE(fields) == held;
        Py_DECREF(fields);
        if (!alike)
            goto differs;
    }
    return out;
differs:
    Py_DECREF(out);
    Py_RETURN_NONE;
error:
    Py_DECREF(out);
    return NULL;
}

/* plain(value, budget, leaves, containers) -> bool: whether `value` is plain data as
 * `_plain_data_problem` counts it: values whose exact type is in `leaves`, nested in values
 * whose exact type is in `containers` (dicts and OrderedDicts: their keys and values; lists,
 * tuples, sets and frozensets: their items), at most `budget` values in all (a container of n
 * items counts n, a dict of n pairs 2n, the value itself 1). Depth first with a stack of its
 * own, bounded by `budget`: deep nesting costs no C stack. Calls nothing of the values. */
static PyObject *
plain(PyObject *module, PyObject *args)
{
    PyObject *value, *leaves, *containers;
    Py_ssize_t budget;
    if (!PyArg_ParseTuple(args, "OnO!O!", &value, &budget, &PyFrozenSet_Type, &leaves,
                          &PyFrozenSet_Type, &containers))
        return NULL;
    Py_ssize_t seen = 1, depth = 0, room = 64;
    PyObject **stack = PyMem_New(PyObject *, room); /* borrowed: the tree holds them */
    if (stack == NULL)
        return PyErr_NoMemory();
    int answer = 1;
    stack[depth++] = value;
    while (depth > 0 && answer == 1) {
        PyObject *v = stack[--depth];
        PyObject *kind = (PyObject *)Py_TYPE(v);
        int in = PySet_Contains(leaves, kind); /* most values are leaves */
        if (in == 0)
            in = PySet_Contains(containers, kind);
        else if (in > 0)
            continue;
        if (in <= 0) {
            answer = in;
            break;
        }
        Py_ssize_t n; /* items to stack */
        if (PyDict_Check(v)) /* a dict or an OrderedDict (its dict holds the same pairs) */
            n = 2 * PyDict_GET_SIZE(v);
        else if (PyList_CheckExact(v) || PyTuple_CheckExact(v))
            n = PySequence_Fast_GET_SIZE(v);
        else if (PyAnySet_CheckExact(v))
            n = PySet_GET_SIZE(v);
        else {
            PyErr_SetString(PyExc_TypeError, "plain: a kind of container it cannot walk");
            answer = -1;
            break;
        }
        seen += n;
        if (seen > budget) { /* counted before its items are stacked */
            answer = 0;
            break;
        }
        if (depth + n > room) {
            room = 2 * (depth + n);
            PyObject **larger = (size_t)room > PY_SSIZE_T_MAX / sizeof(PyObject *)
                                    ? NULL
                                    : PyMem_Realloc(stack, room * sizeof(PyObject *));
            if (larger == NULL) {
                PyErr_NoMemory();
                answer = -1;
                break;
            }
            stack = larger;
        }
        if (PyDict_Check(v)) {
            Py_ssize_t pos = 0;
            PyObject *key, *item;
            while (PyDict_Next(v, &pos, &key, &item)) {
                stack[depth++] = key;
                stack[depth++] = item;
            }
        } else if (!PyAnySet_CheckExact(v)) {
            PyObject **items = PySequence_Fast_ITEMS(v);
            for (Py_ssize_t i = 0; i < n; i++)
                stack[depth++] = items[i];
        } else { /* the set's C iterator: its items are held by the set */
            PyObject *it = PyObject_GetIter(v), *item;
            if (it == NULL) {
                answer = -1;
                break;
            }
            for (Py_ssize_t i = 0; i < n && (item = PyIter_Next(it)) != NULL; i++) {
                stack[depth++] = item;
                Py_DECREF(item);
            }
            Py_DECREF(it);
            if (PyErr_Occurred()) {
                answer = -1;
                break;
            }
        }
    }
    PyMem_Free(stack);
    if (answer < 0)
        return NULL;
    return PyBool_FromLong(answer);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(maker, record): NEWOBJ on maker makes a bare record."},
    {"check_records", check_records, METH_VARARGS,
     "check_records(records, cls, names, kinds, optional, keep): the kept columns, or None."},
    {"plain", plain, METH_VARARGS,
     "plain(value, budget, leaves, containers): whether value is plain data within budget."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "trainckpt.format.safe_unpickle.fast_records",
    .m_doc = "The per-record steps of dcp_allow_list in C (see fast_records.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit_fast_records(void)
{
    if (PyType_Ready(&RecordBase) < 0)
        return NULL;
    bound = PyDict_New();
    no_args = PyTuple_New(0);
    if (bound == NULL || no_args == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "RecordBase", (PyObject *)&RecordBase) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
