/* exporter.kernel._native: the kernel layer's two loops that run at every
 * scrape, each in one call.
 *
 * percpu_sum: a per-CPU map value summed over CPUs. A lookup in a
 * BPF_MAP_TYPE_PERCPU_ARRAY copies one value per possible CPU, each rounded up
 * to 8 bytes (kernel/bpf/arraymap.c, bpf_percpu_array_copy). nettap's per-CPU
 * values are all __u64 words (a struct of them, or an array), so their sum is
 * one column sum per word. Python does it at ~3 us a word on 128 CPUs (3.4 ms
 * a scrape for the 1,024 obs_counters rows); numpy does it fast, but importing
 * numpy costs ~15 MB of RSS that an idle nettap (capturing nothing, scraped
 * every 15 s) has no other use for. Sums wrap at 2^64, as the kernel's
 * counters do.
 *
 * programs: the node's BPF programs and their run-time statistics, the
 * node-wide view's walk (exporter/kernel/bpfstats.py, node_programs). It
 * takes four bpf(2) calls a program (the next id, an fd by id, the info, the
 * close), each a ctypes call from Python at ~1-2 us of interpreter work
 * besides the call itself; here the walk runs without the interpreter lock
 * and builds its list at the end. The fds are closed at once: an fd held
 * between scrapes would keep another tool's unloaded program alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/bpf.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "BPF map values are read as host-order uint64; nettap runs on little-endian machines"
#endif

PyDoc_STRVAR(percpu_sum_doc,
             "percpu_sum(buffer, words) -> list of int\n\n"
             "buffer holds ncpus values of `words` little-endian uint64 each, one after the\n"
             "other (its length must be a multiple of words * 8); returns the `words` sums\n"
             "over CPUs, each modulo 2**64.");

static PyObject *percpu_sum(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t words;
    if (!PyArg_ParseTuple(args, "y*n", &view, &words))
        return NULL;
    if (words <= 0 || view.len % (words * (Py_ssize_t)sizeof(uint64_t))) {
        PyErr_Format(PyExc_ValueError, "percpu_sum: %zd bytes are not whole values of %zd uint64 words", view.len,
                     words);
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t *totals = PyMem_Calloc((size_t)words, sizeof(uint64_t));
    if (totals == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    Py_ssize_t ncpus = view.len / (words * (Py_ssize_t)sizeof(uint64_t));
    const unsigned char *p = view.buf;
    for (Py_ssize_t c = 0; c < ncpus; c++) {
        for (Py_ssize_t w = 0; w < words; w++, p += sizeof(uint64_t)) {
            uint64_t v;
            memcpy(&v, p, sizeof v); /* the buffer need not be aligned */
            totals[w] += v;
        }
    }
    PyBuffer_Release(&view);
    PyObject *out = PyList_New(words);
    for (Py_ssize_t w = 0; out != NULL && w < words; w++) {
        PyObject *n = PyLong_FromUnsignedLongLong(totals[w]);
        if (n == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, w, n);
    }
    PyMem_Free(totals);
    return out;
}

/* ---- the node's programs ------------------------------------------------- */

struct prog_row {
    uint32_t id, type;
    uint64_t run_cnt, run_time_ns;
    char name[BPF_OBJ_NAME_LEN];
};

static long sys_bpf(int cmd, union bpf_attr *attr)
{
    return syscall(__NR_bpf, cmd, attr, sizeof(*attr));
}

/* One program's row, or -1 where it is gone (unloaded since its id was
 * seen) or its info cannot be read: it is left out. */
static int read_prog(uint32_t id, struct prog_row *row)
{
    union bpf_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.prog_id = id;
    int fd = (int)sys_bpf(BPF_PROG_GET_FD_BY_ID, &attr);
    if (fd < 0)
        return -1;
    /* Zeroed: the kernel reads the buffer's counts and pointers (nr_map_ids,
     * ...) as requests. The struct is the build host's uapi's; the kernel
     * fills what it has of it and zeroes the rest (recursion_misses before
     * 5.12). */
    struct bpf_prog_info info;
    memset(&info, 0, sizeof info);
    memset(&attr, 0, sizeof attr);
    attr.info.bpf_fd = (uint32_t)fd;
    attr.info.info_len = sizeof info;
    attr.info.info = (uint64_t)(uintptr_t)&info;
    long err = sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &attr);
    close(fd);
    if (err)
        return -1;
    row->id = info.id;
    row->type = info.type;
    row->run_cnt = info.run_cnt;
    row->run_time_ns = info.run_time_ns;
    memcpy(row->name, info.name, sizeof row->name);
    row->name[sizeof row->name - 1] = '\0';
    return 0;
}

PyDoc_STRVAR(programs_doc,
             "programs() -> list of (id, name, type, run_cnt, run_time_ns)\n\n"
             "Every BPF program on the node, by BPF_PROG_GET_NEXT_ID, BPF_PROG_GET_FD_BY_ID\n"
             "and BPF_OBJ_GET_INFO_BY_FD (CAP_SYS_ADMIN), each fd closed at once. name is\n"
             "the kernel's (15 characters at most), as bytes. A program unloaded during the\n"
             "walk is left out. OSError if the walk itself is refused.");

static PyObject *programs(PyObject *self, PyObject *unused)
{
    size_t cap = 256, n = 0;
    struct prog_row *rows = PyMem_RawMalloc(cap * sizeof *rows);
    if (rows == NULL)
        return PyErr_NoMemory();
    int err = 0, nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    union bpf_attr attr;
    uint32_t id = 0;
    for (;;) {
        memset(&attr, 0, sizeof attr);
        attr.start_id = id;
        if (sys_bpf(BPF_PROG_GET_NEXT_ID, &attr)) {
            err = errno == ENOENT ? 0 : errno;
            break;
        }
        id = attr.next_id;
        if (n == cap) {
            struct prog_row *more = PyMem_RawRealloc(rows, 2 * cap * sizeof *rows);
            if (more == NULL) {
                nomem = 1;
                break;
            }
            rows = more;
            cap *= 2;
        }
        if (read_prog(id, &rows[n]) == 0)
            n++;
    }
    Py_END_ALLOW_THREADS
    if (nomem || err) {
        PyMem_RawFree(rows);
        if (nomem)
            return PyErr_NoMemory();
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        struct prog_row *r = &rows[i];
        PyObject *t = Py_BuildValue("(Iy I KK)", r->id, r->name, r->type, (unsigned long long)r->run_cnt,
                                    (unsigned long long)r->run_time_ns);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    PyMem_RawFree(rows);
    return out;
}

PyDoc_STRVAR(prog_stats_doc,
             "prog_stats(fds) -> list of (run_cnt, run_time_ns, recursion_misses)\n\n"
             "One BPF_OBJ_GET_INFO_BY_FD per program fd of the sequence fds, in its order,\n"
             "without the interpreter lock. OSError where one is refused.");

typedef uint64_t stats_row[3]; /* run_cnt, run_time_ns, recursion_misses */

static PyObject *prog_stats(PyObject *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "prog_stats: expected a sequence of fds");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *fds = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof *fds);
    stats_row *rows = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof *rows);
    PyObject *out = NULL;
    if (fds == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (fd == -1 && PyErr_Occurred())
            goto done;
        fds[i] = (int)fd;
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !err; i++) {
        struct bpf_prog_info info;
        union bpf_attr attr;
        memset(&info, 0, sizeof info);
        memset(&attr, 0, sizeof attr);
        attr.info.bpf_fd = (uint32_t)fds[i];
        attr.info.info_len = sizeof info;
        attr.info.info = (uint64_t)(uintptr_t)&info;
        if (sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &attr)) {
            err = errno;
            break;
        }
        rows[i][0] = info.run_cnt;
        rows[i][1] = info.run_time_ns;
        rows[i][2] = info.recursion_misses;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *t = Py_BuildValue("(KKK)", (unsigned long long)rows[i][0], (unsigned long long)rows[i][1],
                                    (unsigned long long)rows[i][2]);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, t);
    }
done:
    PyMem_RawFree(fds);
    PyMem_RawFree(rows);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"percpu_sum", percpu_sum, METH_VARARGS, percpu_sum_doc},
    {"programs", programs, METH_NOARGS, programs_doc},
    {"prog_stats", prog_stats, METH_O, prog_stats_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
