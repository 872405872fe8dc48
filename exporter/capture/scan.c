/* The ring scan of exporter.capture._jsonl:
 * scan(kinds, data, start, avail, max_records, mode[, counts]) -> (bytes or None, consumed, kept, bad, stop)
 *
 * nettap's ring reader: one pass over the committed records of a BPF ring
 * buffer's data area (`data`, the mapped pages, mapped once; its size a power
 * of two), from byte offset `start` (consumer_pos & mask, 8-aligned) over at
 * most `avail` bytes (producer_pos - consumer_pos) and `max_records` records.
 * Each record is an 8-byte header (length | BUSY | DISCARD, kernel/bpf/
 * ringbuf.c) and its body, the next header at the 8-byte boundary after it.
 * Stops at the first BUSY record (not committed yet). Discarded records are
 * consumed and skipped. A record is its header's kind (its number at
 * kind_off, init()): one the ring carries (bit n of the mask `kinds`) whose
 * length is that kind's size; anything else (a stale object, garbage) is
 * consumed by its own length and counted bad, as is a length that runs past
 * `avail` (the rest is consumed). Runs without the interpreter lock; the
 * caller releases `consumed` bytes afterwards.
 * mode 0: count the kept records; 1: their JSON lines, formatted in place;
 * 2: a copy of their bodies, back to back (a ring of one kind only).
 * stop: 0 avail reached, 1 a BUSY record, 2 max_records reached, 3 cut short.
 * counts, when given: a writable buffer of KINDS_MAX uint64, each kept
 * record added to its kind's.
 * A record whose body crosses the end of the area is copied whole first.
 *
 * And the ring's positions, as libbpf's reader (src/ringbuf.c,
 * ringbuf_process_ring) moves them on every architecture:
 * positions(consumer_page, producer_page) -> (consumer_pos, producer_pos),
 * load-acquires; release(consumer_page, pos), a store-release. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "jsonl.h"

#define RB_BUSY_    (1u << 31)
#define RB_DISCARD_ (1u << 30)
#define RB_HDR_     8
#define RECORD_MAX  4096

/* One pass: what it is asked (the area, where to start, the kinds), what it gave. */
struct walk {
    const char *data;
    size_t size; /* of the area: a power of two */
    Py_ssize_t start, avail, max_records;
    int mode;                /* SCAN_* */
    unsigned long long mask; /* the kinds the ring carries */
    size_t sizes[KINDS_MAX]; /* by kind number: its records' bytes */
    size_t step_min, each_max, rsize_max;
    unsigned kind_off, kind_width;
    uint64_t *counts; /* kept records by kind, or NULL */
    char *p;          /* where the next kept record's output goes */
    Py_ssize_t consumed, kept, bad;
    int stop;
};

/* The kinds of the mask: their sizes, the shortest step a kept record takes
 * and the most output one can give; -1 with an exception set when the mask
 * is not one kind or more (exactly one to copy). */
static int walk_kinds(struct walk *w)
{
    int nmask = 0;
    w->step_min = SIZE_MAX, w->each_max = 0, w->rsize_max = 0;
    for (int k = 0; k < KINDS_MAX; k++) {
        if (!(w->mask >> k & 1))
            continue;
        if (!kind_ready(k))
            return -1;
        size_t size = kind_size(k);
        size_t step = (RB_HDR_ + size + 7) & ~(size_t)7;
        size_t each = w->mode == SCAN_LINES ? line_max(k) : w->mode == SCAN_COPY ? size : 0;
        w->sizes[k] = size;
        w->step_min = step < w->step_min ? step : w->step_min;
        w->each_max = each > w->each_max ? each : w->each_max;
        w->rsize_max = size > w->rsize_max ? size : w->rsize_max;
        nmask++;
    }
    if (nmask == 0 || (w->mask >> KINDS_MAX) || (w->mode == SCAN_COPY && nmask != 1)) {
        PyErr_Format(PyExc_ValueError, "scan: kinds 0x%llx: one kind or more (one to copy)", w->mask);
        return -1;
    }
    kind_field(&w->kind_off, &w->kind_width);
    return 0;
}

/* The walk itself, without the interpreter lock: w->p has room for every
 * record it can keep. */
static void walk(struct walk *w)
{
    const char *data = w->data;
    const size_t size = w->size, mask_area = size - 1;
    const unsigned kind_off = w->kind_off, kind_width = w->kind_width;
    const Py_ssize_t start = w->start, avail = w->avail, max_records = w->max_records;
    const unsigned long long mask = w->mask;
    const int mode = w->mode;
    const size_t rsize_max = w->rsize_max;
    uint64_t *const counts = w->counts;
    size_t sizes[KINDS_MAX]; /* copies: the stores below cannot change them */
    memcpy(sizes, w->sizes, sizeof(sizes));
    Py_ssize_t consumed = 0, kept = 0, bad = 0, seen = 0;
    int stop = 0;
    char *p = w->p;
    char whole[RECORD_MAX];
    for (;;) {
        if (seen == max_records) {
            stop = 2;
            break;
        }
        if (consumed + RB_HDR_ > avail)
            break;
        size_t off = ((size_t)start + (size_t)consumed) & mask_area;
        /* The header before the record it guards: an acquire load pairs
         * with the producer's xchg that cleared BUSY after it wrote the
         * record (kernel/bpf/ringbuf.c, bpf_ringbuf_commit), so the body
         * read below is the committed one (libbpf: smp_load_acquire of len). */
        uint32_t hdr = __atomic_load_n((const uint32_t *)(data + off), __ATOMIC_ACQUIRE);
        if (hdr & RB_BUSY_) {
            stop = 1;
            break;
        }
        size_t len = hdr & ~(RB_BUSY_ | RB_DISCARD_);
        Py_ssize_t step = (Py_ssize_t)((RB_HDR_ + len + 7) & ~(size_t)7);
        seen++;
        if (consumed + step > avail) { /* longer than what was committed */
            bad++;
            consumed = avail;
            stop = 3;
            break;
        }
        consumed += step;
        if (len == 0) { /* no record is empty: garbage, discarded or not */
            bad++;
            continue;
        }
        if (hdr & RB_DISCARD_)
            continue;
        if (len > rsize_max || len < kind_off + kind_width) { /* no kind of this ring is that long */
            bad++;
            continue;
        }
        size_t body = (off + RB_HDR_) & mask_area;
        const char *rec = data + body;
        if (body + len > size) { /* crosses the end: copy it whole */
            size_t first = size - body;
            memcpy(whole, data + body, first);
            memcpy(whole + first, data, len - first);
            rec = whole;
        }
        uint64_t k = get_uint(rec, kind_off, kind_width);
        if (k >= KINDS_MAX || !(mask >> k & 1) || len != sizes[k]) {
            bad++;
            continue;
        }
        if (mode == SCAN_LINES)
            p = format_one((int)k, p, rec);
        else if (mode == SCAN_COPY) {
            memcpy(p, rec, len);
            p += len;
        }
        if (counts)
            counts[k]++;
        kept++;
    }
    w->p = p;
    w->consumed = consumed, w->kept = kept, w->bad = bad, w->stop = stop;
}

/* counts, when given: a writable buffer of KINDS_MAX aligned uint64 (view
 * holds it until released); 0, or -1 with an exception set. */
static int walk_counts(struct walk *w, PyObject *counts_obj, Py_buffer *view)
{
    w->counts = NULL;
    if (counts_obj == NULL || counts_obj == Py_None)
        return 0;
    if (PyObject_GetBuffer(counts_obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (view->len != KINDS_MAX * (Py_ssize_t)sizeof(uint64_t) || (uintptr_t)view->buf % 8) {
        PyErr_Format(PyExc_ValueError, "scan: counts of %zd bytes, not %d aligned uint64", view->len, KINDS_MAX);
        PyBuffer_Release(view);
        return -1;
    }
    w->counts = view->buf;
    return 0;
}

/* 1 when the area and the bounds make a walk; else 0 with an exception set. */
static int walk_geometry(struct walk *w)
{
    Py_ssize_t size = (Py_ssize_t)w->size;
    if (size < (Py_ssize_t)w->step_min || (size & (size - 1)) || w->start < 0 || w->start >= size || w->start % 8 ||
        w->avail < 0 || w->max_records < 0 || w->mode < SCAN_COUNT || w->mode > SCAN_COPY ||
        w->rsize_max > RECORD_MAX) {
        PyErr_Format(PyExc_ValueError, "scan: bad geometry (size %zd, start %zd, avail %zd, max %zd, mode %d)", size,
                     w->start, w->avail, w->max_records, w->mode);
        return 0;
    }
    if (w->avail > size)
        w->avail = size;
    return 1;
}

PyObject *jsonl_scan(PyObject *self, PyObject *args)
{
    struct walk w = {0};
    PyObject *obj, *counts_obj = NULL;
    if (!PyArg_ParseTuple(args, "KOnnni|O:scan", &w.mask, &obj, &w.start, &w.avail, &w.max_records, &w.mode,
                          &counts_obj))
        return NULL;
    if (walk_kinds(&w) < 0)
        return NULL;
    Py_buffer cview = {0}, view;
    if (walk_counts(&w, counts_obj, &cview) < 0)
        return NULL;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
        if (w.counts)
            PyBuffer_Release(&cview);
        return NULL;
    }
    w.data = view.buf, w.size = (size_t)view.len;
    if (!walk_geometry(&w)) {
        PyBuffer_Release(&view);
        if (w.counts)
            PyBuffer_Release(&cview);
        return NULL;
    }
    /* The output's bound: each kept record consumed at least step_min bytes of avail. */
    Py_ssize_t most = w.avail / (Py_ssize_t)w.step_min;
    if (most > w.max_records)
        most = w.max_records;
    struct scratch *buf = NULL;
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    if (w.each_max && most) {
        buf = scratch_take((size_t)most * w.each_max);
        if (buf == NULL)
            nomem = 1;
        else
            w.p = buf->data;
    }
    if (!nomem)
        walk(&w);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (w.counts)
        PyBuffer_Release(&cview);
    if (nomem)
        return PyErr_NoMemory();
    PyObject *out = Py_None;
    Py_INCREF(Py_None);
    if (w.each_max) {
        Py_DECREF(Py_None);
        out = PyBytes_FromStringAndSize(buf != NULL ? buf->data : "", buf != NULL ? (Py_ssize_t)(w.p - buf->data) : 0);
        if (buf != NULL)
            scratch_give(buf);
        if (out == NULL)
            return NULL;
    }
    return Py_BuildValue("(Nnnni)", out, w.consumed, w.kept, w.bad, w.stop);
}

/* ---- the ring's positions ---------------------------------------------------
 * kernel/bpf/ringbuf.c, struct bpf_ringbuf: consumer_pos and producer_pos, each
 * an unsigned long at the start of its own page (page 0, which user space may
 * write, and page 1), 64 bits on every architecture nettap has objects for.
 * The kernel advances producer_pos with smp_store_release after it reserved a
 * record, and reads consumer_pos with smp_load_acquire before it reuses space;
 * these are the other halves of those pairs, the C11 atomics that compile to
 * a plain mov on x86-64 and to ldar / stlr on arm64. */

/* The position at the start of obj's buffer (8 bytes or more, 8-aligned), or
 * NULL with an exception set; view holds the buffer until released. */
static uint64_t *position(PyObject *obj, Py_buffer *view, int flags)
{
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return NULL;
    if (view->len < (Py_ssize_t)sizeof(uint64_t) || (uintptr_t)view->buf % sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "ring position: a buffer of %zd bytes at %p, not an aligned uint64", view->len,
                     view->buf);
        PyBuffer_Release(view);
        return NULL;
    }
    return view->buf;
}

PyObject *jsonl_positions(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "positions(consumer_page, producer_page): %zd arguments", nargs);
        return NULL;
    }
    Py_buffer cview, pview;
    uint64_t *cons = position(args[0], &cview, PyBUF_SIMPLE);
    if (cons == NULL)
        return NULL;
    uint64_t *prod = position(args[1], &pview, PyBUF_SIMPLE);
    if (prod == NULL) {
        PyBuffer_Release(&cview);
        return NULL;
    }
    /* consumer_pos first (only this reader writes it; acquire as libbpf
     * loads it), then producer_pos: every load after this one (record
     * headers, bodies) sees what the producer wrote before advancing it. */
    uint64_t c = __atomic_load_n(cons, __ATOMIC_ACQUIRE);
    uint64_t p = __atomic_load_n(prod, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&pview);
    PyBuffer_Release(&cview);
    PyObject *out = PyTuple_New(2), *v;
    if (out == NULL)
        return NULL;
    for (int i = 0; i < 2; i++) { /* not Py_BuildValue: an idle poll is little more than this call */
        if ((v = PyLong_FromUnsignedLongLong(i ? p : c)) == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

PyObject *jsonl_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "release(consumer_page, pos): %zd arguments", nargs);
        return NULL;
    }
    unsigned long long pos = PyLong_AsUnsignedLongLong(args[1]);
    if (pos == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    uint64_t *cons = position(args[0], &view, PyBUF_WRITABLE);
    if (cons == NULL)
        return NULL;
    /* Every read of the released records (the scan's, before this call)
     * happens before the producer may see their space free. */
    __atomic_store_n(cons, (uint64_t)pos, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}
