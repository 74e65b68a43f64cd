/* The two column steps of reading trainckpt's own metadata record (native_metadata.py) that
 * run once per state entry, in C: at 64,000 entries (240,000 records with the optimizer's
 * hyperparameters) the Python steps took a fifth of a load (docs/scale.md). Optional: where
 * this module is not built, `_fast_tensors` and `_fast_byte_values` do the same in Python, and
 * the tests decode every crafted record both ways (tests/integrity/test_native_columns.py).
 *
 * - `tensors`: the tensor records and the chunk table (the record's int64s, read in place)
 *   made into DCP's `TensorStorageMetadata` of each entry, and the stored piece of each
 *   one-chunk tensor.
 * - `byte_values`: the byte-value records made into the stored piece of each value, values
 *   stored at one place sharing one piece.
 *
 * Both only read their arguments and make new objects of the classes they are given; they
 * answer None wherever a record is not of the common, well-formed kind (a field of another
 * type, a negative or huge number, a repeated name, a file not listed, a tensor of more than
 * `lazy` chunks), and the Python steps then decide, and name what is wrong. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *no_args; /* () */

/* Whether `v` is an int (not a bool) from 0 to 2**63 - 1; its value to `out`. */
static int
natural(PyObject *v, long long *out)
{
    int overflow;
    long long x;
    if (!PyLong_CheckExact(v))
        return 0;
    x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < 0)
        return 0; /* an exact int raises nothing here */
    *out = x;
    return 1;
}

/* The `Size` of `n` numbers (from `numbers`, or from the ints of the list `items`), one object
 * per distinct value (`shapes`); a new reference, or NULL with an error set. */
static PyObject *
shaped(PyObject *shapes, PyObject *size_cls, const long long *numbers, PyObject *items,
       Py_ssize_t n)
{
    PyObject *key = PyTuple_New(n), *found;
    Py_ssize_t i;
    if (key == NULL)
        return NULL;
    for (i = 0; i < n; i++) {
        PyObject *v;
        if (items != NULL) {
            v = PyList_GET_ITEM(items, i);
            Py_INCREF(v);
        }
        else if ((v = PyLong_FromLongLong(numbers[i])) == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyTuple_SET_ITEM(key, i, v);
    }
    found = PyDict_GetItemWithError(shapes, key); /* borrowed */
    if (found != NULL) {
        Py_DECREF(key);
        Py_INCREF(found);
        return found;
    }
    if (PyErr_Occurred() ||
        (found = PyObject_CallOneArg(size_cls, key)) == NULL ||
        PyDict_SetItem(shapes, key, found) < 0) {
        Py_DECREF(key);
        Py_XDECREF(found);
        return NULL;
    }
    Py_DECREF(key);
    return found;
}

/* The `TensorProperties` of a dtype and two flags, one object per distinct kind (`kinds`). */
static PyObject *
properties(PyObject *kinds, PyObject *props_cls, PyObject *dtype, PyObject *grad, PyObject *pin)
{
    PyObject *key = PyTuple_Pack(3, dtype, grad, pin), *found, *fields;
    if (key == NULL)
        return NULL;
    found = PyDict_GetItemWithError(kinds, key);
    if (found != NULL) {
        Py_DECREF(key);
        Py_INCREF(found);
        return found;
    }
    fields = PyErr_Occurred() ? NULL : PyDict_New();
    if (fields == NULL ||
        PyDict_SetItemString(fields, "dtype", dtype) < 0 ||
        PyDict_SetItemString(fields, "requires_grad", grad) < 0 ||
        PyDict_SetItemString(fields, "pin_memory", pin) < 0 ||
        (found = PyObject_Call(props_cls, no_args, fields)) == NULL ||
        PyDict_SetItem(kinds, key, found) < 0) {
        Py_DECREF(key);
        Py_XDECREF(fields);
        Py_XDECREF(found);
        return NULL;
    }
    Py_DECREF(key);
    Py_DECREF(fields);
    return found;
}

#define MAX_NDIM 64 /* native_metadata.MAX_NDIM: a row is read into a buffer of its size */
#define DOUBT 0
#define FAILED (-1)

/* One tensor record (its fields checked by the caller), its chunks read from the int64s at
 * `numbers` from the `*pos`th: adds its entry to `built` and, with one chunk, its piece to
 * `single`; DOUBT, FAILED (an error set) or 1. */
static int
one_tensor(PyObject *fqn, PyObject *props, PyObject *size, long long count,
           const char *numbers, Py_ssize_t total, Py_ssize_t *pos, PyObject *files,
           PyObject *classes[5], PyObject *shapes, PyObject *built, PyObject *single)
{
    PyObject *chunk_cls = classes[1], *tensor_cls = classes[2], *info_cls = classes[3];
    PyObject *size_cls = classes[4];
    Py_ssize_t nd = PyList_GET_SIZE(size), width = 2 * nd + 4, c;
    PyObject *chunks, *whole, *entry;
    int ok;
    if (count * width > total - *pos)
        return DOUBT;
    chunks = PyList_New((Py_ssize_t)count);
    if (chunks == NULL)
        return FAILED;
    for (c = 0; c < count; c++) {
        long long row[2 * MAX_NDIM + 4], file;
        PyObject *offsets, *lengths, *chunk;
        memcpy(row, numbers + 8 * (*pos + c * width), 8 * width);
        file = row[2 * nd + 1];
        if (file < 0 || file >= PyList_GET_SIZE(files) || row[2 * nd + 2] < 0 ||
            row[2 * nd + 3] < 0) {
            Py_DECREF(chunks);
            return DOUBT;
        }
        offsets = shaped(shapes, size_cls, row, NULL, nd);
        lengths = offsets ? shaped(shapes, size_cls, row + nd, NULL, nd) : NULL;
        chunk = lengths ? PyObject_CallFunctionObjArgs(chunk_cls, offsets, lengths, NULL) : NULL;
        Py_XDECREF(offsets);
        Py_XDECREF(lengths);
        if (chunk == NULL) {
            Py_DECREF(chunks);
            return FAILED;
        }
        PyList_SET_ITEM(chunks, c, chunk);
        if (count == 1) {
            PyObject *info = Py_BuildValue("(OLL)", PyList_GET_ITEM(files, file),
                                           row[2 * nd + 2], row[2 * nd + 3]);
            PyObject *piece = info ? PyObject_Call(info_cls, info, NULL) : NULL;
            Py_XDECREF(info);
            if (piece == NULL || PyDict_SetItem(single, fqn, piece) < 0) {
                Py_XDECREF(piece);
                Py_DECREF(chunks);
                return FAILED;
            }
            Py_DECREF(piece);
        }
    }
    *pos += (Py_ssize_t)count * width;
    whole = shaped(shapes, size_cls, NULL, size, nd);
    entry = whole ? PyObject_CallFunctionObjArgs(tensor_cls, props, whole, chunks, NULL) : NULL;
    Py_XDECREF(whole);
    Py_DECREF(chunks);
    ok = entry != NULL && PyDict_SetItem(built, fqn, entry) == 0;
    Py_XDECREF(entry);
    return ok ? 1 : FAILED;
}

/* tensors(records, table, files, dtypes, entries, lazy, max_ndim, classes):
 * (entries made, one-chunk pieces, names, chunk counts, ndims), or None. */
static PyObject *
tensors(PyObject *module, PyObject *args)
{
    PyObject *records, *files, *dtypes, *entries, *classes[5];
    PyObject *built = NULL, *single = NULL, *shapes = NULL, *kinds = NULL;
    PyObject *fqns = NULL, *counts = NULL, *ndims = NULL, *result = NULL;
    Py_buffer table;
    Py_ssize_t lazy, max_ndim, nrec, r, pos = 0, total;
    const char *numbers;
    if (!PyArg_ParseTuple(args, "O!y*O!O!O!nn(OOOOO)", &PyList_Type, &records, &table,
                          &PyList_Type, &files, &PyDict_Type, &dtypes, &PyDict_Type, &entries,
                          &lazy, &max_ndim, &classes[0], &classes[1], &classes[2], &classes[3],
                          &classes[4]))
        return NULL;
#if PY_BIG_ENDIAN
    PyBuffer_Release(&table);
    Py_RETURN_NONE; /* the table is little-endian: the Python steps swap it */
#endif
    if (table.len % 8 != 0 || max_ndim > MAX_NDIM) {
        PyBuffer_Release(&table);
        Py_RETURN_NONE;
    }
    numbers = (const char *)table.buf; /* not aligned: the header's length is any */
    total = table.len / 8;
    nrec = PyList_GET_SIZE(records);
    if ((built = PyDict_New()) == NULL || (single = PyDict_New()) == NULL ||
        (shapes = PyDict_New()) == NULL || (kinds = PyDict_New()) == NULL ||
        (fqns = PyList_New(nrec)) == NULL || (counts = PyList_New(nrec)) == NULL ||
        (ndims = PyList_New(nrec)) == NULL)
        goto done;
    for (r = 0; r < nrec; r++) {
        PyObject *rec = PyList_GET_ITEM(records, r), *fqn, *name, *dtype, *grad, *pin, *size;
        PyObject *props, *nd;
        long long count, n;
        Py_ssize_t i;
        int known, made;
        if (!PyList_CheckExact(rec) || PyList_GET_SIZE(rec) != 6)
            goto doubt;
        fqn = PyList_GET_ITEM(rec, 0);
        name = PyList_GET_ITEM(rec, 1);
        grad = PyList_GET_ITEM(rec, 2);
        pin = PyList_GET_ITEM(rec, 3);
        size = PyList_GET_ITEM(rec, 4);
        if (!PyUnicode_CheckExact(fqn) || !PyUnicode_CheckExact(name) || !PyBool_Check(grad) ||
            !PyBool_Check(pin) || !PyList_CheckExact(size) || PyList_GET_SIZE(size) > max_ndim ||
            !natural(PyList_GET_ITEM(rec, 5), &count) || count > lazy)
            goto doubt;
        for (i = 0; i < PyList_GET_SIZE(size); i++)
            if (!natural(PyList_GET_ITEM(size, i), &n))
                goto doubt;
        if ((known = PyDict_Contains(entries, fqn)) != 0 ||
            (known = PyDict_Contains(built, fqn)) != 0) {
            if (known < 0)
                goto done;
            goto doubt; /* named twice */
        }
        if ((dtype = PyDict_GetItemWithError(dtypes, name)) == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto doubt;
        }
        if ((props = properties(kinds, classes[0], dtype, grad, pin)) == NULL)
            goto done;
        made = one_tensor(fqn, props, size, count, numbers, total, &pos, files, classes, shapes,
                          built, single);
        Py_DECREF(props);
        if (made == FAILED)
            goto done;
        if (made == DOUBT)
            goto doubt;
        if ((nd = PyLong_FromSsize_t(PyList_GET_SIZE(size))) == NULL)
            goto done;
        Py_INCREF(fqn);
        PyList_SET_ITEM(fqns, r, fqn);
        Py_INCREF(PyList_GET_ITEM(rec, 5));
        PyList_SET_ITEM(counts, r, PyList_GET_ITEM(rec, 5));
        PyList_SET_ITEM(ndims, r, nd);
    }
    if (pos != total)
        goto doubt; /* the table holds more than the records' chunks */
    result = PyTuple_Pack(5, built, single, fqns, counts, ndims);
    goto done;
doubt:
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&table);
    Py_XDECREF(built);
    Py_XDECREF(single);
    Py_XDECREF(shapes);
    Py_XDECREF(kinds);
    Py_XDECREF(fqns);
    Py_XDECREF(counts);
    Py_XDECREF(ndims);
    return result;
}

/* byte_values(records, files, entries, info_cls): (the piece of each value by name, the index
 * hints in that order), or None. */
static PyObject *
byte_values(PyObject *module, PyObject *args)
{
    PyObject *records, *files, *entries, *info_cls;
    PyObject *infos = NULL, *places = NULL, *hints = NULL, *result = NULL;
    Py_ssize_t nrec, r;
    if (!PyArg_ParseTuple(args, "O!O!O!O", &PyList_Type, &records, &PyList_Type, &files,
                          &PyDict_Type, &entries, &info_cls))
        return NULL;
    nrec = PyList_GET_SIZE(records);
    if ((infos = PyDict_New()) == NULL || (places = PyDict_New()) == NULL ||
        (hints = PyList_New(nrec)) == NULL)
        goto done;
    for (r = 0; r < nrec; r++) {
        PyObject *rec = PyList_GET_ITEM(records, r), *fqn, *place, *piece;
        long long numbers[4];
        Py_ssize_t i;
        int known;
        if (!PyList_CheckExact(rec) || PyList_GET_SIZE(rec) != 5)
            goto doubt;
        fqn = PyList_GET_ITEM(rec, 0);
        if (!PyUnicode_CheckExact(fqn))
            goto doubt;
        for (i = 0; i < 4; i++)
            if (!natural(PyList_GET_ITEM(rec, i + 1), &numbers[i]))
                goto doubt;
        if (numbers[1] >= PyList_GET_SIZE(files))
            goto doubt; /* its file is not listed */
        if ((known = PyDict_Contains(entries, fqn)) != 0) {
            if (known < 0)
                goto done;
            goto doubt;
        }
        place = PyTuple_Pack(3, PyList_GET_ITEM(rec, 2), PyList_GET_ITEM(rec, 3),
                             PyList_GET_ITEM(rec, 4));
        if (place == NULL)
            goto done;
        piece = PyDict_GetItemWithError(places, place);
        if (piece != NULL)
            Py_INCREF(piece);
        else if (PyErr_Occurred() ||
                 (piece = PyObject_CallFunctionObjArgs(
                      info_cls, PyList_GET_ITEM(files, numbers[1]), PyList_GET_ITEM(rec, 3),
                      PyList_GET_ITEM(rec, 4), NULL)) == NULL ||
                 PyDict_SetItem(places, place, piece) < 0) {
            Py_DECREF(place);
            Py_XDECREF(piece);
            goto done;
        }
        Py_DECREF(place);
        if (PyDict_SetItem(infos, fqn, piece) < 0) {
            Py_DECREF(piece);
            goto done;
        }
        Py_DECREF(piece);
        Py_INCREF(PyList_GET_ITEM(rec, 1));
        PyList_SET_ITEM(hints, r, PyList_GET_ITEM(rec, 1));
    }
    if (PyDict_GET_SIZE(infos) != nrec)
        goto doubt; /* a name given twice */
    result = PyTuple_Pack(2, infos, hints);
    goto done;
doubt:
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(infos);
    Py_XDECREF(places);
    Py_XDECREF(hints);
    return result;
}

static PyMethodDef methods[] = {
    {"tensors", tensors, METH_VARARGS,
     "tensors(records, table, files, dtypes, entries, lazy, max_ndim, classes): "
     "(entries, pieces, names, counts, ndims), or None."},
    {"byte_values", byte_values, METH_VARARGS,
     "byte_values(records, files, entries, info_cls): (pieces, hints), or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "trainckpt.format.native_columns",
    .m_doc = "The per-entry column steps of native_metadata in C (see native_columns.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit_native_columns(void)
{
    if (no_args == NULL && (no_args = PyTuple_New(0)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
