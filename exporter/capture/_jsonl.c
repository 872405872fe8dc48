/* exporter.capture._jsonl: nettap's ring reader and JSON-lines writer, compiled.
 *
 * One module of three files, by job: the writer (writer.c: init(), format(), line_max(), and
 * one record's line), the ring scan (scan.c: scan(), which formats the records it keeps in
 * place with the writer's tables, and the ring's positions: positions(), release()), and this
 * one, what Python sees: the calls, and the numbers records.py and ringbuf.py build their
 * arguments from (jsonl.h, which ingest's line split, exporter/ingest/_split.c, shares). One module, not two: the scan walks the writer's tables,
 * and one shared object is one load at import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "jsonl.h"

static PyMethodDef methods[] = {
    {"format", jsonl_format, METH_VARARGS,
     "format(kind, records) -> bytes: one JSON line per record of an init() kind, "
     "each ended by a newline; runs without the GIL."},
    {"init", jsonl_init, METH_VARARGS,
     "init(enum_tables, flag_tables, kinds, kind_field): the name tables (quoted bytes or None per value; "
     "flags as (bit, quoted name)), per kind number (record size, rows (prefix, op, offset, width, arg, "
     "arg_width)) or None, and (offset, bytes) of the kind number in every record's header."},
    {"scan", jsonl_scan, METH_VARARGS,
     "scan(kinds, data, start, avail, max_records, mode[, counts]) -> (bytes or None, consumed, kept, bad, stop): "
     "one pass over a ring's committed records of the kinds in the mask (mode SCAN_COUNT, SCAN_LINES "
     "its JSON lines, SCAN_COPY its records); runs without the GIL."},
    {"positions", (PyCFunction)(void (*)(void))jsonl_positions, METH_FASTCALL,
     "positions(consumer_page, producer_page) -> (consumer_pos, producer_pos): the uint64 at the start of "
     "each buffer, load-acquired (the producer's records before producer_pos are visible after it)."},
    {"release", (PyCFunction)(void (*)(void))jsonl_release, METH_FASTCALL,
     "release(consumer_page, pos): pos stored at the start of the writable buffer, store-released "
     "(every read of the records before pos happens before the producer sees their space free)."},
    {"line_max", jsonl_line_max, METH_VARARGS,
     "line_max(kind) -> the longest line (newline included) a record of that kind can give."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jsonl", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* OPS: JSON form -> op number, as init()'s rows take it. */
static int add_ops(PyObject *m)
{
    PyObject *ops = PyDict_New();
    int ok = ops != NULL;
#define JSONL_OP_ITEM(op, form)                                    \
    if (ok) {                                                      \
        PyObject *v = PyLong_FromLong(op);                         \
        ok = v != NULL && PyDict_SetItemString(ops, form, v) == 0; \
        Py_XDECREF(v);                                             \
    }
    JSONL_FORM_OPS(JSONL_OP_ITEM)
#undef JSONL_OP_ITEM
    if (ok && PyModule_AddObject(m, "OPS", ops) == 0)
        return 0;
    Py_XDECREF(ops);
    return -1;
}

PyMODINIT_FUNC PyInit__jsonl(void)
{
    writer_setup();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (add_ops(m) < 0 || PyModule_AddIntConstant(m, "OP_LIT", OP_LIT) < 0 ||
        PyModule_AddIntConstant(m, "KINDS_MAX", KINDS_MAX) < 0 ||
        PyModule_AddIntConstant(m, "SCAN_COUNT", SCAN_COUNT) < 0 ||
        PyModule_AddIntConstant(m, "SCAN_LINES", SCAN_LINES) < 0 ||
        PyModule_AddIntConstant(m, "SCAN_COPY", SCAN_COPY) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
