/* What the JSON-lines writer (writer.c), the ring scan (scan.c) and ingest's line split
 * (exporter/ingest/_split.c) share: the numbers of the line format and of the writer's rows,
 * and the writer's calls the scan makes. Include it after <Python.h>.
 *
 * Python reads these numbers from the modules (exporter.capture._jsonl's OPS, OP_LIT,
 * KINDS_MAX and SCAN_*, exporter.ingest._split's KIND_NAME_MAX), never from a copy of its own.
 */
#ifndef NETTAP_JSONL_H
#define NETTAP_JSONL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the record layouts are little-endian (bpf/tcp.h as exporter/capture/records.py reads it)"
#endif

/* ---- the line format ---------------------------------------------------- */

#define KINDS_MAX     32 /* kind numbers 0-31: the writer's kinds, the scan's mask bits and counts */
#define KIND_NAME_MAX 32 /* bytes of a kind's name, the value of a line's "type" ([A-Za-z0-9_-]) */

/* ---- the writer's rows ---------------------------------------------------
 * How a row's value is written, by its field's JSON form (docs/records.md, "JSON forms"; ""
 * a number): init() takes rows of these numbers, which records.py reads from the module
 * (_jsonl.OPS: form -> op, and _jsonl.OP_LIT, a row of text only). */
#define JSONL_FORM_OPS(X)  \
    X(OP_UINT, "")         \
    X(OP_TEXT, "text")     \
    X(OP_ADDR, "addr")     \
    X(OP_FAMILY, "family") \
    X(OP_ENUM, "enum")     \
    X(OP_FLAGS, "flags")   \
    X(OP_BASE64, "base64")
#define JSONL_OP_NUMBER(op, form) op,
enum {
    OP_LIT,
    JSONL_FORM_OPS(JSONL_OP_NUMBER) NOPS,
    OP_U64 = NOPS, /* OP_UINT by width, chosen at init */
    OP_U32,
    OP_U16,
    OP_U8,
    OP_END, /* the line's last text: a closing literal, }\n */
};

/* ---- the scan's modes (scan.c): what it gives for the records it keeps ---- */
enum { SCAN_COUNT, SCAN_LINES, SCAN_COPY };

/* ---- the writer's calls the scan makes (writer.c) -------------------------
 * Hidden: calls inside the module, not through its symbol table. */
#define JSONL_INTERNAL __attribute__((visibility("hidden")))

/* A scratch buffer lines are formatted into, kept for the next call (writer.c says why). */
struct scratch {
    size_t cap;
    char data[];
};
JSONL_INTERNAL struct scratch *scratch_take(size_t need);
JSONL_INTERNAL void scratch_give(struct scratch *s);

JSONL_INTERNAL int kind_ready(int kind);                             /* 0 with an exception set: not a kind */
JSONL_INTERNAL size_t kind_size(int kind);                           /* bytes of a record of that kind */
JSONL_INTERNAL size_t line_max(int kind);                            /* bytes of its longest line, slack included */
JSONL_INTERNAL void kind_field(unsigned *off, unsigned *width);      /* the header's kind number */
JSONL_INTERNAL char *format_one(int kind, char *p, const char *rec); /* one record's line at p */

/* The module's calls (_jsonl.c's method table). */
JSONL_INTERNAL PyObject *jsonl_init(PyObject *self, PyObject *args);
JSONL_INTERNAL PyObject *jsonl_format(PyObject *self, PyObject *args);
JSONL_INTERNAL PyObject *jsonl_line_max(PyObject *self, PyObject *args);
JSONL_INTERNAL PyObject *jsonl_scan(PyObject *self, PyObject *args);
JSONL_INTERNAL PyObject *jsonl_positions(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
JSONL_INTERNAL PyObject *jsonl_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
JSONL_INTERNAL void writer_setup(void);

/* An unsigned integer of 1, 2, 4 or 8 bytes at rec + off. */
static inline uint64_t get_uint(const char *rec, unsigned off, unsigned width)
{
    switch (width) {
    case 8: {
        uint64_t v;
        memcpy(&v, rec + off, 8);
        return v;
    }
    case 4: {
        uint32_t v;
        memcpy(&v, rec + off, 4);
        return v;
    }
    case 2: {
        uint16_t v;
        memcpy(&v, rec + off, 2);
        return v;
    }
    default: return (uint8_t)rec[off];
    }
}

#endif
