/* exporter.capture._jsonl: the JSON lines of a whole batch of ring records in one call.
 *
 * nettap's only writer and ring reader (scan, below). The pure-Python writer
 * in tests/oracles.py (chunk_lines, eof_lines, log_lines) is the reference it
 * is tested against: the same bytes, line for line (tests/unit/test_jsonl.py
 * checks the committed fixtures and thousands of random records). format(kind, records) takes a 1-D numpy
 * array of the ring's record dtype (contiguous or strided, e.g. a field view
 * of ring slots) and returns bytes: every line, each ended by "\n". The loop
 * runs without the interpreter lock, so the ring-drain thread is never
 * starved by formatting.
 *
 * Enum names (directions, chunk flags, TCP states, log codes, probes) are not
 * written here: records.py hands its own tables to init() once, pre-quoted.
 * The record layouts are written here; records.py compares layout() with its
 * numpy dtypes at import and refuses a module that disagrees.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the record layouts are little-endian (bpf/tcp.h as exporter/capture/records.py reads it)"
#endif

#define CHUNK_DATA 400
#define AF_INET_ 2
#define AF_INET6_ 10

struct __attribute__((packed)) chunk {
    uint64_t conn_id, ts_ns, offset, call_offset;
    uint32_t call_len, len, pid, tid;
    uint16_t family, sport, dport;
    uint8_t direction, flags;
    uint8_t saddr[16], daddr[16], comm[16];
    uint8_t data[CHUNK_DATA];
};

struct __attribute__((packed)) eof {
    uint64_t conn_id, ts_ns, start_ns, tx_bytes, rx_bytes;
    uint32_t pid, tid;
    uint16_t family, sport, dport;
    uint8_t oldstate, pad0;
    uint8_t saddr[16], daddr[16], comm[16];
    uint64_t tx_calls, rx_calls;
};

struct __attribute__((packed)) log_ {
    uint64_t ts_ns;
    uint32_t code, probe;
    uint64_t arg0, arg1;
    uint32_t pid, tid;
    uint8_t comm[16];
};

enum { KIND_CHUNK, KIND_EOF, KIND_LOG, NKINDS };

/* ---- name tables, from records.py ------------------------------------- */

enum { T_DIRECTION, T_STATE, T_CODE, T_PROBE, NTABLES };
#define TABLE_MAX 256            /* larger values are printed as numbers */
#define NAME_MAX_ 64             /* bytes of one quoted name */

typedef struct { uint8_t n; char s[NAME_MAX_]; } name_t;   /* n == 0: no name */
static name_t tables[NTABLES][TABLE_MAX];
static size_t table_max[NTABLES];                         /* longest name */

#define NFLAGS_MAX 8
static struct { uint8_t bit; uint8_t n; char s[NAME_MAX_]; } flag_names[NFLAGS_MAX];
static int nflags;
static unsigned known_flags;
static size_t flags_max;                                   /* bytes of all names, commas */

static int initialised;

/* ---- small writers ---------------------------------------------------- */

static const char DIGITS2[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";
static const char HEX[] = "0123456789abcdef";
static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
static char B64_12[4096][2];       /* 12 bits -> 2 base64 characters */
static char DEC8[256][4];          /* 0..255 in decimal, length in [3] */

#define LIT(p, s) (memcpy((p), (s), sizeof(s) - 1), (p) + sizeof(s) - 1)

static const uint64_t POW10[20] = {
    1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull, 10000000ull, 100000000ull,
    1000000000ull, 10000000000ull, 100000000000ull, 1000000000000ull, 10000000000000ull,
    100000000000000ull, 1000000000000000ull, 10000000000000000ull, 100000000000000000ull,
    1000000000000000000ull, 10000000000000000000ull,
};

/* Decimal digits of v (1..20). */
static inline int ndigits(uint64_t v)
{
    int t = (64 - __builtin_clzll(v | 1)) * 1233 >> 12;     /* floor(log10(2^bits)) */
    return t + ((v | 1) >= POW10[t]);                         /* v | 1: 0 has one digit */
}

/* v in decimal, written backwards from its last digit: no length-dependent copy. */
static inline char *put_u64(char *p, uint64_t v)
{
    int n = ndigits(v);
    char *e = p + n, *q = e;
    while (v >= 100) {
        unsigned r = (unsigned)(v % 100);
        v /= 100;
        q -= 2;
        memcpy(q, DIGITS2 + 2 * r, 2);
    }
    if (v >= 10) {
        q -= 2;
        memcpy(q, DIGITS2 + 2 * v, 2);
    } else {
        *--q = (char)('0' + v);
    }
    return e;
}

static inline char *put_u32(char *p, uint32_t v)
{
    int n = ndigits(v);
    char *e = p + n, *q = e;
    while (v >= 100) {
        unsigned r = v % 100;
        v /= 100;
        q -= 2;
        memcpy(q, DIGITS2 + 2 * r, 2);
    }
    if (v >= 10) {
        q -= 2;
        memcpy(q, DIGITS2 + 2 * v, 2);
    } else {
        *--q = (char)('0' + v);
    }
    return e;
}

/* A name from a table ("name", quoted), or the value as a quoted number. */
static inline char *put_enum(char *p, int t, uint32_t v)
{
    if (v < TABLE_MAX && tables[t][v].n) {
        memcpy(p, tables[t][v].s, NAME_MAX_);              /* fixed size: inlined; slack after */
        return p + tables[t][v].n;
    }
    *p++ = '"';
    p = put_u32(p, v);
    *p++ = '"';
    return p;
}

/* JSON escapes of json.dumps(..., ensure_ascii=False): ", \, \b \f \n \r \t,
 * other control characters as \u00xx (lowercase hex); everything else raw. */
static inline char *put_escaped(char *p, unsigned c)
{
    *p++ = '\\';
    switch (c) {
    case '"': *p++ = '"'; break;
    case '\\': *p++ = '\\'; break;
    case '\b': *p++ = 'b'; break;
    case '\f': *p++ = 'f'; break;
    case '\n': *p++ = 'n'; break;
    case '\r': *p++ = 'r'; break;
    case '\t': *p++ = 't'; break;
    default:
        p = LIT(p, "u00");
        *p++ = HEX[c >> 4];
        *p++ = HEX[c & 15];
    }
    return p;
}

/* The rest of a task name from its first byte that is not plain ASCII:
 * UTF-8 decoded as Python's "replace" error handler (and Rust's
 * String::from_utf8_lossy) do it, one U+FFFD per maximal invalid subpart,
 * then JSON-escaped. */
static char *put_text_slow(char *p, const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            if (c < 0x20 || c == '"' || c == '\\')
                p = put_escaped(p, c);
            else
                *p++ = (char)c;
            i++;
            continue;
        }
        unsigned need, lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            need = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            if (c == 0xE0) lo = 0xA0;          /* no overlongs */
            else if (c == 0xED) hi = 0x9F;     /* no surrogates */
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0) lo = 0x90;          /* no overlongs */
            else if (c == 0xF4) hi = 0x8F;     /* nothing above U+10FFFF */
        } else {                               /* 80..C1, F5..FF: never a start */
            p = LIT(p, "\xef\xbf\xbd");
            i++;
            continue;
        }
        size_t j = i + 1;
        if (j < n && s[j] >= lo && s[j] <= hi) {
            j++;
            while (j < n && j <= i + need && s[j] >= 0x80 && s[j] <= 0xBF)
                j++;
        }
        if (j == i + need + 1) {               /* a whole, valid sequence */
            memcpy(p, s + i, need + 1);
            p += need + 1;
        } else {                               /* its longest valid prefix: one U+FFFD */
            p = LIT(p, "\xef\xbf\xbd");
        }
        i = j;
    }
    return p;
}

/* A task name (char comm[16]): to its first NUL, quoted. */
static inline char *put_text(char *p, const uint8_t *s)
{
    size_t n = 0, i;
    while (n < 16 && s[n])
        n++;
    *p++ = '"';
    for (i = 0; i < n; i++) {
        unsigned c = s[i];
        if (c < 0x20 || c == '"' || c == '\\' || c >= 0x80)
            break;
    }
    memcpy(p, s, 16);                      /* the plain-ASCII start; the buffer has room */
    p += i;
    if (i < n)
        p = put_text_slow(p, s + i, n - i);
    *p++ = '"';
    return p;
}

static inline char *put_ip4(char *p, const uint8_t *a)
{
    for (int k = 0; k < 4; k++) {
        if (k)
            *p++ = '.';
        memcpy(p, DEC8[a[k]], 3);
        p += DEC8[a[k]][3];
    }
    return p;
}

static inline char *put_hex16(char *p, unsigned w)
{
    if (w >= 0x1000) *p++ = HEX[w >> 12];
    if (w >= 0x100) *p++ = HEX[(w >> 8) & 15];
    if (w >= 0x10) *p++ = HEX[(w >> 4) & 15];
    *p++ = HEX[w & 15];
    return p;
}

/* inet_ntop(AF_INET6) as glibc (and so Python's socket.inet_ntop) writes it:
 * the longest run of two or more zero groups (the first of equal runs) as
 * "::", and ::a.b.c.d / ::ffff:a.b.c.d with the last 32 bits dotted. */
static char *put_ip6(char *p, const uint8_t *a)
{
    unsigned w[8];
    int best = -1, best_len = 0, cur = -1, cur_len = 0, i;
    for (i = 0; i < 8; i++)
        w[i] = (unsigned)a[2 * i] << 8 | a[2 * i + 1];
    for (i = 0; i < 8; i++) {
        if (w[i] == 0) {
            if (cur == -1)
                cur = i, cur_len = 1;
            else
                cur_len++;
        } else if (cur != -1) {
            if (best == -1 || cur_len > best_len)
                best = cur, best_len = cur_len;
            cur = -1;
        }
    }
    if (cur != -1 && (best == -1 || cur_len > best_len))
        best = cur, best_len = cur_len;
    if (best != -1 && best_len < 2)
        best = -1;
    for (i = 0; i < 8; i++) {
        if (best != -1 && i >= best && i < best + best_len) {
            if (i == best)
                *p++ = ':';
            continue;
        }
        if (i != 0)
            *p++ = ':';
        if (i == 6 && best == 0 && (best_len == 6 || (best_len == 5 && w[5] == 0xffff)))
            return put_ip4(p, a + 12);
        p = put_hex16(p, w[i]);
    }
    if (best != -1 && best + best_len == 8)
        *p++ = ':';
    return p;
}

/* "address" as records._addr: inet_ntop for AF_INET/AF_INET6, else the 16 raw bytes in hex. */
static inline char *put_addr(char *p, unsigned family, const uint8_t *a)
{
    *p++ = '"';
    if (family == AF_INET_) {
        p = put_ip4(p, a);
    } else if (family == AF_INET6_) {
        p = put_ip6(p, a);
    } else {
        for (int k = 0; k < 16; k++) {
            *p++ = HEX[a[k] >> 4];
            *p++ = HEX[a[k] & 15];
        }
    }
    *p++ = '"';
    return p;
}

static inline char *put_family(char *p, unsigned family)
{
    if (family == AF_INET_)
        return LIT(p, "\"ipv4\"");
    if (family == AF_INET6_)
        return LIT(p, "\"ipv6\"");
    *p++ = '"';
    p = put_u32(p, family);
    *p++ = '"';
    return p;
}

static inline char *put_flags(char *p, unsigned v)
{
    int first = 1;
    *p++ = '[';
    for (int k = 0; k < nflags; k++) {
        if (v & flag_names[k].bit) {
            if (!first)
                *p++ = ',';
            first = 0;
            memcpy(p, flag_names[k].s, NAME_MAX_);
            p += flag_names[k].n;
        }
    }
    unsigned rest = v & ~known_flags;
    if (rest) {                                /* unknown bits: "0x.." */
        if (!first)
            *p++ = ',';
        p = LIT(p, "\"0x");
        if (rest >= 0x10)
            *p++ = HEX[(rest >> 4) & 15];
        *p++ = HEX[rest & 15];
        *p++ = '"';
    }
    *p++ = ']';
    return p;
}

static inline char *put_base64(char *p, const uint8_t *s, size_t n)
{
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        memcpy(p, B64_12[v >> 12], 2);
        memcpy(p + 2, B64_12[v & 4095], 2);
        p += 4;
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)s[i] << 16;
        p[0] = B64[v >> 18];
        p[1] = B64[(v >> 12) & 63];
        p[2] = p[3] = '=';
        p += 4;
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8;
        p[0] = B64[v >> 18];
        p[1] = B64[(v >> 12) & 63];
        p[2] = B64[(v >> 6) & 63];
        p[3] = '=';
        p += 4;
    }
    return p;
}

/* ---- one line per record, keys in byte order (as records.py) ----------- */

static char *chunk_line(char *p, const struct chunk *r)
{
    uint32_t n = r->len < CHUNK_DATA ? r->len : CHUNK_DATA;
    p = LIT(p, "{\"call_len\":");
    p = put_u32(p, r->call_len);
    p = LIT(p, ",\"call_offset\":");
    p = put_u64(p, r->call_offset);
    p = LIT(p, ",\"comm\":");
    p = put_text(p, r->comm);
    p = LIT(p, ",\"conn_id\":");
    p = put_u64(p, r->conn_id);
    p = LIT(p, ",\"daddr\":");
    p = put_addr(p, r->family, r->daddr);
    p = LIT(p, ",\"data\":\"");
    p = put_base64(p, r->data, n);
    p = LIT(p, "\",\"direction\":");
    p = put_enum(p, T_DIRECTION, r->direction);
    p = LIT(p, ",\"dport\":");
    p = put_u32(p, r->dport);
    p = LIT(p, ",\"family\":");
    p = put_family(p, r->family);
    p = LIT(p, ",\"flags\":");
    p = put_flags(p, r->flags);
    p = LIT(p, ",\"len\":");
    p = put_u32(p, r->len);
    p = LIT(p, ",\"offset\":");
    p = put_u64(p, r->offset);
    p = LIT(p, ",\"pid\":");
    p = put_u32(p, r->pid);
    p = LIT(p, ",\"saddr\":");
    p = put_addr(p, r->family, r->saddr);
    p = LIT(p, ",\"sport\":");
    p = put_u32(p, r->sport);
    p = LIT(p, ",\"tid\":");
    p = put_u32(p, r->tid);
    p = LIT(p, ",\"ts_ns\":");
    p = put_u64(p, r->ts_ns);
    return LIT(p, ",\"type\":\"chunk\"}\n");
}

static char *eof_line(char *p, const struct eof *r)
{
    p = LIT(p, "{\"comm\":");
    p = put_text(p, r->comm);
    p = LIT(p, ",\"conn_id\":");
    p = put_u64(p, r->conn_id);
    p = LIT(p, ",\"daddr\":");
    p = put_addr(p, r->family, r->daddr);
    p = LIT(p, ",\"dport\":");
    p = put_u32(p, r->dport);
    p = LIT(p, ",\"family\":");
    p = put_family(p, r->family);
    p = LIT(p, ",\"oldstate\":");
    p = put_enum(p, T_STATE, r->oldstate);
    p = LIT(p, ",\"pid\":");
    p = put_u32(p, r->pid);
    p = LIT(p, ",\"rx_bytes\":");
    p = put_u64(p, r->rx_bytes);
    p = LIT(p, ",\"rx_calls\":");
    p = put_u64(p, r->rx_calls);
    p = LIT(p, ",\"saddr\":");
    p = put_addr(p, r->family, r->saddr);
    p = LIT(p, ",\"sport\":");
    p = put_u32(p, r->sport);
    p = LIT(p, ",\"start_ns\":");
    p = put_u64(p, r->start_ns);
    p = LIT(p, ",\"tid\":");
    p = put_u32(p, r->tid);
    p = LIT(p, ",\"ts_ns\":");
    p = put_u64(p, r->ts_ns);
    p = LIT(p, ",\"tx_bytes\":");
    p = put_u64(p, r->tx_bytes);
    p = LIT(p, ",\"tx_calls\":");
    p = put_u64(p, r->tx_calls);
    return LIT(p, ",\"type\":\"eof\"}\n");
}

static char *log_line(char *p, const struct log_ *r)
{
    p = LIT(p, "{\"arg0\":");
    p = put_u64(p, r->arg0);
    p = LIT(p, ",\"arg1\":");
    p = put_u64(p, r->arg1);
    p = LIT(p, ",\"code\":");
    p = put_enum(p, T_CODE, r->code);
    p = LIT(p, ",\"comm\":");
    p = put_text(p, r->comm);
    p = LIT(p, ",\"pid\":");
    p = put_u32(p, r->pid);
    p = LIT(p, ",\"probe\":");
    p = put_enum(p, T_PROBE, r->probe);
    p = LIT(p, ",\"tid\":");
    p = put_u32(p, r->tid);
    p = LIT(p, ",\"ts_ns\":");
    p = put_u64(p, r->ts_ns);
    return LIT(p, ",\"type\":\"log\"}\n");
}

/* Bytes one line can take at most (text + slack for put_text's 16-byte copy). */
static size_t line_max(int kind)
{
    /* keys and punctuation < 320; u64 <= 20, u32 <= 10 digits; comm <= 16 * 6
     * escaped + 16 slack; an address <= 45 (IPv6) or 32 (hex); base64 of 400
     * bytes = 536. */
    switch (kind) {
    case KIND_CHUNK:
        return 320 + 4 * 20 + 7 * 10 + (2 + 96 + 16) + 2 * 47 + 536 + 12 + table_max[T_DIRECTION] + flags_max + 64;
    case KIND_EOF:
        return 320 + 7 * 20 + 5 * 10 + (2 + 96 + 16) + 2 * 47 + 12 + table_max[T_STATE] + 64;
    default:
        return 320 + 3 * 20 + 5 * 10 + (2 + 96 + 16) + table_max[T_CODE] + table_max[T_PROBE] + 64;
    }
}

static const size_t record_size[NKINDS] = {sizeof(struct chunk), sizeof(struct eof), sizeof(struct log_)};

/* ---- the module -------------------------------------------------------- */

/* Lines are formatted into a scratch buffer that is kept for the next call,
 * then copied into a bytes object of their exact size. Fresh memory for
 * every batch (a worst-case bytes object, shrunk after) costs a page fault
 * per 4 KiB written: a third of the time on eof records. One buffer is kept
 * (taken and given back atomically, so concurrent calls each get their own),
 * and only up to SCRATCH_KEEP bytes of address space: enough for the worst
 * case of a whole default chunk ring (16,384 records); only the pages a batch
 * wrote are resident (~13 MiB for 16,384 full chunks). */
struct scratch { size_t cap; char data[]; };
#define SLACK 256           /* fixed-size copies (names, a task name) may write past a line's end */
#define SCRATCH_KEEP (32u << 20)
static struct scratch *_Atomic spare;

static struct scratch *scratch_take(size_t need)
{
    struct scratch *s = atomic_exchange(&spare, NULL);
    if (s != NULL && s->cap >= need + SLACK)
        return s;
    free(s);
    size_t cap = (need < (1u << 20) ? (1u << 20) : need) + SLACK;
    s = malloc(sizeof(*s) + cap);
    if (s != NULL)
        s->cap = cap;
    return s;
}

static void scratch_give(struct scratch *s)
{
    if (s->cap > SCRATCH_KEEP) {
        free(s);
        return;
    }
    free(atomic_exchange(&spare, s));
}

/* 1 when kind names a record kind and init() has run; else 0 with an exception set. */
static int kind_ready(int kind)
{
    if (!initialised) {
        PyErr_SetString(PyExc_RuntimeError, "_jsonl.init() was not called");
        return 0;
    }
    if (kind < 0 || kind >= NKINDS) {
        PyErr_Format(PyExc_ValueError, "unknown record kind %d", kind);
        return 0;
    }
    return 1;
}

/* One record's line at p; returns the end of what it wrote. */
static inline char *format_one(int kind, char *p, const char *rec)
{
    switch (kind) {
    case KIND_CHUNK: return chunk_line(p, (const struct chunk *)rec);
    case KIND_EOF: return eof_line(p, (const struct eof *)rec);
    default: return log_line(p, (const struct log_ *)rec);
    }
}

static PyObject *jsonl_format(PyObject *self, PyObject *args)
{
    int kind;
    PyObject *arr;
    if (!PyArg_ParseTuple(args, "iO:format", &kind, &arr))
        return NULL;
    if (!kind_ready(kind))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_STRIDES) < 0)
        return NULL;
    if (view.ndim != 1 || (size_t)view.itemsize != record_size[kind]) {
        PyErr_Format(PyExc_ValueError, "records must be a 1-D array of %zu-byte items (got ndim %d, itemsize %zd)",
                     record_size[kind], view.ndim, view.itemsize);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t count = view.shape[0], stride = view.strides[0];
    size_t lmax = line_max(kind);
    if (count < 0 || (size_t)count > (size_t)(PY_SSIZE_T_MAX / 2) / lmax) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    size_t need = (size_t)count * lmax, used = 0;
    struct scratch *buf = NULL;
    const char *rec = view.buf;
    Py_BEGIN_ALLOW_THREADS
    buf = scratch_take(need);
    if (buf != NULL) {
        char *p = buf->data;
        for (Py_ssize_t i = 0; i < count; i++, rec += stride)
            p = format_one(kind, p, rec);
        used = (size_t)(p - buf->data);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (buf == NULL)
        return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)used);
    if (out != NULL) {
        if (used > (1 << 16)) {
            Py_BEGIN_ALLOW_THREADS
            memcpy(PyBytes_AS_STRING(out), buf->data, used);
            Py_END_ALLOW_THREADS
        } else {
            memcpy(PyBytes_AS_STRING(out), buf->data, used);
        }
    }
    scratch_give(buf);
    return out;
}

/* scan(kind, data, start, avail, max_records, mode) -> (bytes or None, consumed, kept, bad, stop)
 *
 * nettap's ring reader: one pass over the committed records of a BPF ring
 * buffer's data area (`data`, the mapped pages, mapped once; its size a power
 * of two), from byte offset `start` (consumer_pos & mask, 8-aligned) over at
 * most `avail` bytes (producer_pos - consumer_pos) and `max_records` records.
 * Each record is an 8-byte header (length | BUSY | DISCARD, kernel/bpf/
 * ringbuf.c) and its body, the next header at the 8-byte boundary after it.
 * Stops at the first BUSY record (not committed yet). Discarded records are
 * consumed and skipped; a record whose length is not the kind's record size
 * (a stale object, or garbage) is consumed by its own length and counted bad,
 * as is a length that runs past `avail` (the rest is consumed). Runs without
 * the interpreter lock; the caller releases `consumed` bytes afterwards.
 * mode 0: count the kept records; 1: their JSON lines, formatted in place;
 * 2: a copy of their bodies, back to back.
 * stop: 0 avail reached, 1 a BUSY record, 2 max_records reached, 3 cut short.
 * A record whose body crosses the end of the area (only after a record of
 * a foreign size moved the walk off the stride) is copied whole first. */
#define RB_BUSY_ (1u << 31)
#define RB_DISCARD_ (1u << 30)
#define RB_HDR_ 8
#define RECORD_MAX 4096

enum { SCAN_COUNT, SCAN_LINES, SCAN_COPY };

static PyObject *jsonl_scan(PyObject *self, PyObject *args)
{
    int kind, mode;
    PyObject *obj;
    Py_ssize_t start, avail, max_records;
    if (!PyArg_ParseTuple(args, "iOnnni:scan", &kind, &obj, &start, &avail, &max_records, &mode))
        return NULL;
    if (!kind_ready(kind))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t size = view.len;
    size_t rsize = record_size[kind];
    size_t step_good = (RB_HDR_ + rsize + 7) & ~(size_t)7;
    if (size < (Py_ssize_t)step_good || (size & (size - 1)) || start < 0 || start >= size || start % 8 ||
        avail < 0 || max_records < 0 || mode < SCAN_COUNT || mode > SCAN_COPY || rsize > RECORD_MAX) {
        PyErr_Format(PyExc_ValueError, "scan: bad geometry (size %zd, start %zd, avail %zd, max %zd, mode %d)",
                     size, start, avail, max_records, mode);
        PyBuffer_Release(&view);
        return NULL;
    }
    if (avail > size)
        avail = size;
    /* The output's bound: each kept record consumed step_good bytes of avail. */
    Py_ssize_t most = avail / (Py_ssize_t)step_good;
    if (most > max_records)
        most = max_records;
    size_t each = mode == SCAN_LINES ? line_max(kind) : mode == SCAN_COPY ? rsize : 0;
    struct scratch *buf = NULL;
    Py_ssize_t consumed = 0, kept = 0, bad = 0, seen = 0;
    int stop = 0, nomem = 0;
    const char *data = view.buf;
    size_t mask = (size_t)size - 1;
    char *p = NULL;
    char whole[RECORD_MAX];
    Py_BEGIN_ALLOW_THREADS
    if (each && most) {
        buf = scratch_take((size_t)most * each);
        if (buf == NULL)
            nomem = 1;
        else
            p = buf->data;
    }
    while (!nomem) {
        if (seen == max_records) {
            stop = 2;
            break;
        }
        if (consumed + RB_HDR_ > avail)
            break;
        size_t off = ((size_t)start + (size_t)consumed) & mask;
        /* The header before the record it guards (an acquire load: x86-64
         * keeps loads in order, this keeps the compiler from moving them). */
        uint32_t hdr = __atomic_load_n((const uint32_t *)(data + off), __ATOMIC_ACQUIRE);
        if (hdr & RB_BUSY_) {
            stop = 1;
            break;
        }
        size_t len = hdr & ~(RB_BUSY_ | RB_DISCARD_);
        Py_ssize_t step = (Py_ssize_t)((RB_HDR_ + len + 7) & ~(size_t)7);
        seen++;
        if (consumed + step > avail) {                  /* longer than what was committed */
            bad++;
            consumed = avail;
            stop = 3;
            break;
        }
        consumed += step;
        if (len == 0) {                                 /* no record is empty: garbage, discarded or not */
            bad++;
            continue;
        }
        if (hdr & RB_DISCARD_)
            continue;
        if (len != rsize) {
            bad++;
            continue;
        }
        size_t body = (off + RB_HDR_) & mask;
        const char *rec = data + body;
        if (body + rsize > (size_t)size) {              /* crosses the end: copy it whole */
            size_t first = (size_t)size - body;
            memcpy(whole, data + body, first);
            memcpy(whole + first, data, rsize - first);
            rec = whole;
        }
        if (mode == SCAN_LINES)
            p = format_one(kind, p, rec);
        else if (mode == SCAN_COPY) {
            memcpy(p, rec, rsize);
            p += rsize;
        }
        kept++;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (nomem)
        return PyErr_NoMemory();
    PyObject *out = Py_None;
    Py_INCREF(Py_None);
    if (each) {
        Py_DECREF(Py_None);
        out = PyBytes_FromStringAndSize(buf != NULL ? buf->data : "", buf != NULL ? (Py_ssize_t)(p - buf->data) : 0);
        if (buf != NULL)
            scratch_give(buf);
        if (out == NULL)
            return NULL;
    }
    return Py_BuildValue("(Nnnni)", out, consumed, kept, bad, stop);
}

/* One table: a sequence whose item i is bytes (the quoted name of value i) or None. */
static int load_table(PyObject *seq, int t)
{
    PyObject *fast = PySequence_Fast(seq, "a name table must be a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > TABLE_MAX) {
        PyErr_Format(PyExc_ValueError, "a name table holds at most %d names", TABLE_MAX);
        Py_DECREF(fast);
        return -1;
    }
    memset(tables[t], 0, sizeof(tables[t]));
    table_max[t] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        if (o == Py_None)
            continue;
        if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) == 0 || PyBytes_GET_SIZE(o) >= NAME_MAX_) {
            PyErr_SetString(PyExc_ValueError, "a name must be bytes of 1..63 bytes, or None");
            Py_DECREF(fast);
            return -1;
        }
        tables[t][i].n = (uint8_t)PyBytes_GET_SIZE(o);
        memcpy(tables[t][i].s, PyBytes_AS_STRING(o), tables[t][i].n);
        if (tables[t][i].n > table_max[t])
            table_max[t] = tables[t][i].n;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *jsonl_init(PyObject *self, PyObject *args)
{
    PyObject *dirs, *flags, *states, *codes, *probes;
    if (!PyArg_ParseTuple(args, "OOOOO:init", &dirs, &flags, &states, &codes, &probes))
        return NULL;
    initialised = 0;
    if (load_table(dirs, T_DIRECTION) < 0 || load_table(states, T_STATE) < 0 ||
        load_table(codes, T_CODE) < 0 || load_table(probes, T_PROBE) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(flags, "flags must be a sequence of (bit, name)");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > NFLAGS_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many flags");
        Py_DECREF(fast);
        return NULL;
    }
    nflags = 0;
    known_flags = 0;
    flags_max = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int bit;
        const char *s;
        Py_ssize_t len;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iy#", &bit, &s, &len)) {
            Py_DECREF(fast);
            return NULL;
        }
        if (bit <= 0 || bit > 0xff || (bit & (bit - 1)) || len <= 0 || len >= NAME_MAX_) {
            PyErr_SetString(PyExc_ValueError, "a flag is (a bit of a u8, a quoted name of 1..63 bytes)");
            Py_DECREF(fast);
            return NULL;
        }
        flag_names[nflags].bit = (uint8_t)bit;
        flag_names[nflags].n = (uint8_t)len;
        memcpy(flag_names[nflags].s, s, (size_t)len);
        known_flags |= (unsigned)bit;
        flags_max += (size_t)len + 1;
        nflags++;
    }
    Py_DECREF(fast);
    flags_max += 8;                                     /* ,"0xff" */
    initialised = 1;
    Py_RETURN_NONE;
}

#define FIELD(s, f) #f, (int)offsetof(struct s, f)

static PyObject *jsonl_layout(PyObject *self, PyObject *unused)
{
    return Py_BuildValue(
        "{s:(n{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}),"
        "s:(n{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}),"
        "s:(n{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i})}",
        "capture_chunks", (Py_ssize_t)sizeof(struct chunk),
        FIELD(chunk, conn_id), FIELD(chunk, ts_ns), FIELD(chunk, offset), FIELD(chunk, call_offset),
        FIELD(chunk, call_len), FIELD(chunk, len), FIELD(chunk, pid), FIELD(chunk, tid),
        FIELD(chunk, family), FIELD(chunk, sport), FIELD(chunk, dport), FIELD(chunk, direction),
        FIELD(chunk, flags), FIELD(chunk, saddr), FIELD(chunk, daddr), FIELD(chunk, comm),
        FIELD(chunk, data),
        "capture_eof", (Py_ssize_t)sizeof(struct eof),
        FIELD(eof, conn_id), FIELD(eof, ts_ns), FIELD(eof, start_ns), FIELD(eof, tx_bytes),
        FIELD(eof, rx_bytes), FIELD(eof, pid), FIELD(eof, tid), FIELD(eof, family), FIELD(eof, sport),
        FIELD(eof, dport), FIELD(eof, oldstate), FIELD(eof, pad0), FIELD(eof, saddr), FIELD(eof, daddr),
        FIELD(eof, comm), FIELD(eof, tx_calls), FIELD(eof, rx_calls),
        "logs", (Py_ssize_t)sizeof(struct log_),
        FIELD(log_, ts_ns), FIELD(log_, code), FIELD(log_, probe), FIELD(log_, arg0), FIELD(log_, arg1),
        FIELD(log_, pid), FIELD(log_, tid), FIELD(log_, comm));
}

static PyObject *jsonl_line_max(PyObject *self, PyObject *args)
{
    int kind;
    if (!PyArg_ParseTuple(args, "i:line_max", &kind))
        return NULL;
    if (kind < 0 || kind >= NKINDS) {
        PyErr_Format(PyExc_ValueError, "unknown record kind %d", kind);
        return NULL;
    }
    return PyLong_FromSize_t(line_max(kind));
}

static PyMethodDef methods[] = {
    {"format", jsonl_format, METH_VARARGS,
     "format(kind, records) -> bytes: one JSON line per record (kind 0 chunk, 1 eof, 2 log), "
     "each ended by a newline; runs without the GIL."},
    {"init", jsonl_init, METH_VARARGS,
     "init(directions, flags, states, codes, probes): the name tables (quoted bytes or None per value; "
     "flags as (bit, quoted name))."},
    {"scan", jsonl_scan, METH_VARARGS,
     "scan(kind, data, start, avail, max_records, mode) -> (bytes or None, consumed, kept, bad, stop): "
     "one pass over a ring's committed records (mode 0 count, 1 JSON lines, 2 copies); runs without the GIL."},
    {"line_max", jsonl_line_max, METH_VARARGS,
     "line_max(kind) -> the longest line (newline included) a record of that kind can give."},
    {"layout", jsonl_layout, METH_NOARGS, "layout() -> {ring: (itemsize, {field: offset})}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jsonl", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jsonl(void)
{
    for (int v = 0; v < 4096; v++) {
        B64_12[v][0] = B64[v >> 6];
        B64_12[v][1] = B64[v & 63];
    }
    for (int v = 0; v < 256; v++) {
        int n = snprintf(DEC8[v], 4, "%d", v);
        DEC8[v][3] = (char)n;
    }
    return PyModule_Create(&module);
}
