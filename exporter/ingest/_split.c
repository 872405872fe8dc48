/* exporter.ingest._split: what nettap ingest sends, a region of a capture file (complete
 * lines) as one payload per record kind.
 *
 * kind_split(data): every line the capture's writer makes holds its kind, `"type":"KIND"`
 * (keys in byte order, so "type" is one of a record's last keys: only an owner's "via"
 * comes after it). A ring's records come in runs, but the obs_events ring mixes its kinds a
 * few lines at a time, so the lines are gathered here, not in Python (~1 us a run there).
 * Returns [(kind, payload, lines)] in the order the kinds first appear, payload None when
 * the region holds one kind (it is its own payload); or None when a line has no kind (a
 * line that is not a record, a last line without its newline) or the region has more than
 * SPLIT_KINDS_MAX kinds: exporter/ingest/batches.py then goes line by line, with the same
 * rule (and KIND_NAME_MAX, read from this module).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../capture/jsonl.h"

static int kind_char(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

/* The kind of line [s, e) (e just past its '\n'): its start and length, or
 * -1. The key is the last `"type":"` that a kind of 1 to KIND_NAME_MAX
 * [A-Za-z0-9_-] and `"` then `,` or `}` follow; searched from the end, where
 * it is. Inside a JSON string every '"' is escaped, so these bytes there are
 * never a key. */
static Py_ssize_t line_kind(const unsigned char *s, const unsigned char *e, Py_ssize_t *len)
{
    static const char TYPE[] = "\"type\":\"";
    const Py_ssize_t tl = sizeof(TYPE) - 1;
    if (e - s < tl + 3 || e[-1] != '\n')
        return -1;
    for (const unsigned char *q = e - 1 - (tl + 3); q >= s; q--) {
        if (*q != '"' || memcmp(q, TYPE, tl) != 0)
            continue;
        const unsigned char *b = q + tl, *k = b;
        while (k < e && kind_char(*k) && k - b <= KIND_NAME_MAX)
            k++;
        if (k == b || k - b > KIND_NAME_MAX || k + 1 >= e || k[0] != '"' || (k[1] != ',' && k[1] != '}'))
            continue;
        *len = k - b;
        return b - s;
    }
    return -1;
}

#define SPLIT_KINDS_MAX 32 /* every record kind, the clock track and the run marks, with room */

struct kind_acc {
    const unsigned char *k; /* the kind's name, in the region */
    Py_ssize_t len, bytes, lines;
    char *w; /* where its next lines go, in its payload */
};

static int kind_index(struct kind_acc *acc, int n, int last, const unsigned char *k, Py_ssize_t len)
{
    if (last >= 0 && acc[last].len == len && memcmp(acc[last].k, k, len) == 0)
        return last;
    for (int i = 0; i < n; i++)
        if (acc[i].len == len && memcmp(acc[i].k, k, len) == 0)
            return i;
    return -1;
}

/* One pass over [d, end): with w NULL, the kinds and their sizes (0, or -1
 * for no kind on a line or too many kinds); else each run of lines copied to
 * its kind's acc[].w. */
static int kind_pass(const unsigned char *d, const unsigned char *end, struct kind_acc *acc, int *n, int copy)
{
    const unsigned char *run = d;
    int last = -1;
    for (const unsigned char *p = d; p < end;) {
        const unsigned char *nl = memchr(p, '\n', end - p);
        Py_ssize_t klen, ko;
        if (!nl || (ko = line_kind(p, nl + 1, &klen)) < 0)
            return -1;
        int i = kind_index(acc, *n, last, p + ko, klen);
        if (i < 0) {
            if (copy || *n == SPLIT_KINDS_MAX)
                return -1;
            i = (*n)++;
            acc[i] = (struct kind_acc){p + ko, klen, 0, 0, NULL};
        }
        if (copy && i != last && last >= 0) {
            memcpy(acc[last].w, run, p - run);
            acc[last].w += p - run;
            run = p;
        }
        if (!copy) {
            acc[i].bytes += nl + 1 - p;
            acc[i].lines++;
        }
        last = i;
        p = nl + 1;
    }
    if (copy && last >= 0)
        memcpy(acc[last].w, run, end - run);
    return 0;
}

static PyObject *split_kind_split(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    struct kind_acc acc[SPLIT_KINDS_MAX];
    int n = 0, rc;
    if (!PyArg_ParseTuple(args, "y*:kind_split", &buf))
        return NULL;
    const unsigned char *d = buf.buf, *end = d + buf.len;
    Py_BEGIN_ALLOW_THREADS
    rc = kind_pass(d, end, acc, &n, 0);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyBuffer_Release(&buf);
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    for (int i = 0; out && i < n; i++) {
        PyObject *payload = n > 1 ? PyBytes_FromStringAndSize(NULL, acc[i].bytes) : Py_NewRef(Py_None);
        acc[i].w = payload && n > 1 ? PyBytes_AS_STRING(payload) : NULL;
        PyObject *t = payload ? Py_BuildValue("(y#Nn)", acc[i].k, acc[i].len, payload, acc[i].lines) : NULL;
        if (!t)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, t);
    }
    if (out && n > 1) {
        Py_BEGIN_ALLOW_THREADS
        kind_pass(d, end, acc, &n, 1);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"kind_split", split_kind_split, METH_VARARGS,
     "kind_split(data) -> [(kind, payload, lines)]: data's complete lines gathered by record kind (a line's "
     "last \"type\" key), payload None when there is one kind; None when a line has no kind or no newline, "
     "or there are more than SPLIT_KINDS_MAX kinds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_split", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__split(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "KIND_NAME_MAX", KIND_NAME_MAX) < 0 ||
        PyModule_AddIntConstant(m, "SPLIT_KINDS_MAX", SPLIT_KINDS_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
