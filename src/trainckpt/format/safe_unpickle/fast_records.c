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
 * - `by_class`: a list parted by the exact classes of its values (a None answer: the Python
 *   check names the odd one).
 * - `plain`: whether `planner_data` is plain data within its budget; on False the Python walk
 *   names the problem.
 * - `memo_beyond`: the walk of the opcodes that refuses a memo index out of proportion to the
 *   file (dcp_metadata.py), before the unpickler runs.
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

/* by_class(values, classes) -> a tuple of lists, or None: `values` (a list) parted by their
 * exact class, one list per class of `classes` (a tuple), in order; None if a value is of
 * none of them. */
static PyObject *
by_class(PyObject *module, PyObject *args)
{
    PyObject *values, *classes;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &values, &PyTuple_Type, &classes))
        return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(classes);
    PyObject *out = PyTuple_New(k);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *part = PyList_New(0);
        if (part == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, j, part);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values); i++) {
        PyObject *value = PyList_GET_ITEM(values, i);
        Py_ssize_t j = 0;
        while (j < k && (PyObject *)Py_TYPE(value) != PyTuple_GET_ITEM(classes, j))
            j++;
        if (j == k) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        if (PyList_Append(PyTuple_GET_ITEM(out, j), value) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
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

/* memo_beyond(data, kinds, limit) -> int: the offset of the first PUT or LONG_BINPUT before
 * STOP whose memo index is `limit` or more, else -1. `kinds` (dcp_metadata._ARG_KINDS) gives,
 * for each opcode byte, how its argument is laid out: n >= 0 bytes, or ARG_* below. The walk
 * stops where the unpickler would stop reading (STOP, an unknown opcode, a truncated or
 * malformed argument): what lies past it is never unpickled. Reads `data` only. */
enum { ARG_LINE = -1, ARG_LEN1 = -2, ARG_LEN4 = -3, ARG_LEN4U = -4, ARG_LEN8U = -5,
       ARG_TWO_LINES = -6, ARG_STOP = -7, ARG_UNKNOWN = -8 };

static Py_ssize_t
line_end(const char *data, Py_ssize_t at, Py_ssize_t size) /* after its newline, or -1 */
{
    const char *nl = at < size ? memchr(data + at, '\n', (size_t)(size - at)) : NULL;
    return nl == NULL ? -1 : (nl - data) + 1;
}

static PyObject *
memo_beyond(PyObject *module, PyObject *args)
{
    Py_buffer view;
    PyObject *kinds;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "y*O!n", &view, &PyTuple_Type, &kinds, &limit))
        return NULL;
    if (PyTuple_GET_SIZE(kinds) != 256) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "memo_beyond: one kind per opcode byte");
        return NULL;
    }
    signed char kind_of[256];
    for (int op = 0; op < 256; op++) {
        long k = PyLong_AsLong(PyTuple_GET_ITEM(kinds, op));
        if ((k == -1 && PyErr_Occurred()) || k < ARG_UNKNOWN || k > 8) {
            PyBuffer_Release(&view);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "memo_beyond: an argument kind");
            return NULL;
        }
        kind_of[op] = (signed char)k;
    }
    const char *data = view.buf;
    const unsigned char *bytes = view.buf;
    Py_ssize_t size = view.len, at = 0, found = -1;
    while (at < size) {
        Py_ssize_t start = at, arg = at + 1, next;
        unsigned char op = bytes[at];
        int kind = kind_of[op];
        if (kind >= 0) { /* most opcodes: a fixed argument (MEMOIZE, BININT1, TUPLE2, ...) */
            next = arg + kind;
            if (next > size)
                break;
            if (op == 'r' && kind == 4) { /* LONG_BINPUT: a 4-byte unsigned index */
                unsigned long long index = (unsigned long long)bytes[arg] |
                                           (unsigned long long)bytes[arg + 1] << 8 |
                                           (unsigned long long)bytes[arg + 2] << 16 |
                                           (unsigned long long)bytes[arg + 3] << 24;
                if (index >= (unsigned long long)limit) {
                    found = start;
                    break;
                }
            }
            at = next;
            continue;
        }
        if (kind == ARG_STOP || kind == ARG_UNKNOWN)
            break;
        if (kind == ARG_LINE || kind == ARG_TWO_LINES) {
            next = line_end(data, arg, size);
            if (next >= 0 && kind == ARG_TWO_LINES)
                next = line_end(data, next, size);
            if (next < 0)
                break;
        } else { /* a length, then as many bytes */
            int width = kind == ARG_LEN1 ? 1 : kind == ARG_LEN8U ? 8 : 4;
            if (arg + width > size)
                break;
            unsigned long long n = 0;
            for (int i = width - 1; i >= 0; i--)
                n = (n << 8) | bytes[arg + i];
            if ((kind == ARG_LEN4 && n >= 0x80000000ULL) ||
                n > (unsigned long long)(size - arg - width))
                break; /* negative or past the end: the unpickler stops here */
            next = arg + width + (Py_ssize_t)n;
        }
        if (op == 'p' && kind == ARG_LINE) { /* PUT: a decimal index, as CPython reads it */
            PyObject *line = PyBytes_FromStringAndSize(data + arg, next - arg);
            if (line == NULL) {
                PyBuffer_Release(&view);
                return NULL;
            }
            PyObject *index = PyLong_FromString(PyBytes_AS_STRING(line), NULL, 10);
            Py_DECREF(line);
            if (index == NULL) {
                PyErr_Clear(); /* not a number: the unpickler stops here */
                break;
            }
            Py_ssize_t i = PyLong_AsSsize_t(index);
            Py_DECREF(index);
            if (i == -1 && PyErr_Occurred())
                PyErr_Clear(); /* past any size */
            else if (i < limit) {
                at = next;
                continue;
            }
            found = start;
            break;
        }
        at = next;
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(found);
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(maker, record): NEWOBJ on maker makes a bare record."},
    {"check_records", check_records, METH_VARARGS,
     "check_records(records, cls, names, kinds, optional, keep): the kept columns, or None."},
    {"by_class", by_class, METH_VARARGS,
     "by_class(values, classes): the values parted by exact class, or None."},
    {"plain", plain, METH_VARARGS,
     "plain(value, budget, leaves, containers): whether value is plain data within budget."},
    {"memo_beyond", memo_beyond, METH_VARARGS,
     "memo_beyond(data, kinds, limit): where a memo index reaches limit, else -1."},
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
