/* The JSON-lines writer of exporter.capture._jsonl: the JSON lines of a whole batch of ring
 * records in one call, and one record's line for the ring scan (scan.c), which formats in place.
 *
 * It knows no record kind: init() gives it, per kind, a table of rows (one per JSON key, in byte
 * order: the text before the value, the field's offset and width, how it is written) and the
 * name tables, which records.py builds from the field tables generated from bpf/tcp.h
 * (exporter/kernel/tcp_h.py). The pure-Python writer in tests/oracles.py walks the same tables
 * and is the reference it is tested against: the same bytes, line for line
 * (tests/unit/test_jsonl.py checks the committed fixtures and thousands of random records).
 * format(kind, records) takes a 1-D numpy array of the ring's record dtype (contiguous or
 * strided, e.g. a field view of ring slots) and returns bytes: every line, each ended by "\n".
 * The loop runs without the interpreter lock, so the ring-drain thread is never starved by
 * formatting.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "jsonl.h"

#define AF_INET_  2
#define AF_INET6_ 10

/* ---- the tables init() is given -----------------------------------------
 * exporter/capture/records.py builds them from exporter/kernel/tcp_h.py, which
 * scripts/gen_layout.py generates from bpf/tcp.h and the object's BTF: per
 * record kind, one row per JSON key in byte order (the text before the value,
 * where the field is, how it is written), and the name tables. No record
 * layout is written here. */

#define TABLE_MAX  256 /* larger values are printed as numbers */
#define NAME_MAX_  64  /* bytes of one quoted name */
#define TABLES_MAX 16
#define NFLAGS_MAX 32
#define ROWS_MAX   48 /* an OP_END row included */
#define PREFIX_MAX 32 /* a row's text before its value: ,"key": (and a literal) */
#define TEXT_BYTES 16 /* a task name's array, and an address's */

typedef struct {
    uint8_t n;
    char s[NAME_MAX_];
} name_t; /* n == 0: no name */
static name_t enums[TABLES_MAX][TABLE_MAX];
static size_t enum_max[TABLES_MAX]; /* longest name */
static int nenums;

static struct {
    uint64_t bit;
    uint8_t n;
    char s[NAME_MAX_];
} flag_names[TABLES_MAX][NFLAGS_MAX];
static int nflags[TABLES_MAX];
static uint64_t known_flags[TABLES_MAX];
static size_t flags_max[TABLES_MAX]; /* bytes of all names, commas, unknown bits */
static int nflagtables;

struct row {
    char prefix[PREFIX_MAX]; /* {"key": or ,"key": (OP_LIT: ,"type":"kind") */
    uint8_t op, plen;        /* plen: bytes of prefix */
    uint16_t off, width;     /* the field: offset, bytes */
    uint16_t arg, arg_width; /* ADDR: the family field; BASE64: the length field (offset, bytes);
                                  * ENUM, FLAGS: the table */
} __attribute__((aligned(16)));
struct kind {
    size_t size, line_max;
    int nrows;
    struct row rows[ROWS_MAX];
};                                   /* size 0: no such kind */
static struct kind kinds[KINDS_MAX]; /* by kind number (NETTAP_KIND_*) */
static int nkinds;
static unsigned kind_off, kind_width; /* where a record's header holds its kind number */

static int initialised;

/* ---- small writers ---------------------------------------------------- */

static const char DIGITS2[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";
static const char HEX[] = "0123456789abcdef";
static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
static char B64_12[4096][2]; /* 12 bits -> 2 base64 characters */
static char DEC8[256][4];    /* 0..255 in decimal, length in [3] */

#define LIT(p, s) (memcpy((p), (s), sizeof(s) - 1), (p) + sizeof(s) - 1)

/* clang-format off */
static const uint64_t POW10[20] = {
    1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull, 10000000ull, 100000000ull,
    1000000000ull, 10000000000ull, 100000000000ull, 1000000000000ull, 10000000000000ull,
    100000000000000ull, 1000000000000000ull, 10000000000000000ull, 100000000000000000ull,
    1000000000000000000ull, 10000000000000000000ull,
};
/* clang-format on */

/* Decimal digits of v (1..20). */
static inline int ndigits(uint64_t v)
{
    int t = (64 - __builtin_clzll(v | 1)) * 1233 >> 12; /* floor(log10(2^bits)) */
    return t + ((v | 1) >= POW10[t]);                   /* v | 1: 0 has one digit */
}

/* v in decimal, written backwards from its last digit: no length-dependent copy. */
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

/* v < 10^8 as exactly 8 digits. */
static inline char *put_8digits(char *p, uint32_t v)
{
    uint32_t a = v / 10000, b = v % 10000;
    memcpy(p, DIGITS2 + 2 * (a / 100), 2);
    memcpy(p + 2, DIGITS2 + 2 * (a % 100), 2);
    memcpy(p + 4, DIGITS2 + 2 * (b / 100), 2);
    memcpy(p + 6, DIGITS2 + 2 * (b % 100), 2);
    return p + 8;
}

/* v in decimal: past 32 bits, 8 digits at a time in 32-bit arithmetic
 * (a timestamp's 19 digits in three parts, not ten 64-bit steps). */
static inline char *put_u64(char *p, uint64_t v)
{
    if (v <= UINT32_MAX)
        return put_u32(p, (uint32_t)v);
    uint64_t hi = v / 100000000;
    uint32_t lo = (uint32_t)(v - hi * 100000000);
    if (hi <= UINT32_MAX) {
        p = put_u32(p, (uint32_t)hi);
    } else {
        uint64_t top = hi / 100000000; /* < 1845 */
        p = put_u32(p, (uint32_t)top);
        p = put_8digits(p, (uint32_t)(hi - top * 100000000));
    }
    return put_8digits(p, lo);
}

/* A name from a table ("name", quoted), or the value as a quoted number. */
static inline char *put_enum(char *p, int t, uint64_t v)
{
    if (v < TABLE_MAX && enums[t][v].n) {
        memcpy(p, enums[t][v].s, NAME_MAX_); /* fixed size: inlined; slack after */
        return p + enums[t][v].n;
    }
    *p++ = '"';
    p = put_u64(p, v);
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
            if (c == 0xE0)
                lo = 0xA0; /* no overlongs */
            else if (c == 0xED)
                hi = 0x9F; /* no surrogates */
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            if (c == 0xF0)
                lo = 0x90; /* no overlongs */
            else if (c == 0xF4)
                hi = 0x8F; /* nothing above U+10FFFF */
        } else {           /* 80..C1, F5..FF: never a start */
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
        if (j == i + need + 1) { /* a whole, valid sequence */
            memcpy(p, s + i, need + 1);
            p += need + 1;
        } else { /* its longest valid prefix: one U+FFFD */
            p = LIT(p, "\xef\xbf\xbd");
        }
        i = j;
    }
    return p;
}

/* A task name (char comm[16]): to its first NUL, quoted. */
/* clang-format off */
#define ONES 0x0101010101010101ull
#define HIGHS 0x8080808080808080ull
#define ZERO_BYTE(v) (((v) - ONES) & ~(v) & HIGHS)
/* clang-format on */

/* Index of the first byte of s[0..16) that ends plain ASCII text (a NUL,
 * another control character, '"', '\\' or a byte >= 0x80), or 16: eight
 * bytes at a time. Each test flags that byte exactly, and may flag bytes
 * after it (borrows), so the lowest flag is the first such byte. */
static inline int first_special(const uint8_t *s)
{
    for (int h = 0; h < 16; h += 8) {
        uint64_t w;
        memcpy(&w, s + h, 8);
        uint64_t m =
            ((w - ONES * 0x20) & ~w & HIGHS) | (w & HIGHS) | ZERO_BYTE(w ^ (ONES * '"')) | ZERO_BYTE(w ^ (ONES * '\\'));
        if (m)
            return h + (__builtin_ctzll(m) >> 3);
    }
    return 16;
}

static inline char *put_text(char *p, const uint8_t *s)
{
    int i = first_special(s);
    *p++ = '"';
    memcpy(p, s, 16); /* the plain-ASCII start; the buffer has room */
    p += i;
    if (i < 16 && s[i]) { /* not the NUL ending it: escapes, UTF-8 */
        size_t n = (size_t)i;
        while (n < 16 && s[n])
            n++;
        p = put_text_slow(p, s + i, n - (size_t)i);
    }
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
    if (w >= 0x1000)
        *p++ = HEX[w >> 12];
    if (w >= 0x100)
        *p++ = HEX[(w >> 8) & 15];
    if (w >= 0x10)
        *p++ = HEX[(w >> 4) & 15];
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

static inline char *put_flags(char *p, int t, uint64_t v)
{
    int first = 1;
    *p++ = '[';
    for (int k = 0; k < nflags[t]; k++) {
        if (v & flag_names[t][k].bit) {
            if (!first)
                *p++ = ',';
            first = 0;
            memcpy(p, flag_names[t][k].s, NAME_MAX_);
            p += flag_names[t][k].n;
        }
    }
    uint64_t rest = v & ~known_flags[t];
    if (rest) { /* unknown bits: "0x.." as Python's {:#x} */
        if (!first)
            *p++ = ',';
        p = LIT(p, "\"0x");
        int shift = 60;
        while (shift > 0 && !(rest >> shift))
            shift -= 4;
        for (; shift >= 0; shift -= 4)
            *p++ = HEX[(rest >> shift) & 15];
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

/* ---- one line per record: its kind's rows, keys in byte order ------------ */

/* One record's line at p; returns the end of what it wrote. Threaded: each
 * value's code copies the next row's text and jumps to that row's code
 * itself, so every jump is predicted on its own (a kind's rows repeat the
 * same sequence record after record) and a line costs about what straight
 * code written for the kind did (bench/writer.py --against). */
char *format_one(int kind, char *p, const char *rec)
{
    static const void *const code[] = {
        [OP_END] = &&end,       [OP_LIT] = &&lit,         [OP_TEXT] = &&text,   [OP_ADDR] = &&addr,
        [OP_FAMILY] = &&family, [OP_ENUM] = &&enumerated, [OP_FLAGS] = &&flags, [OP_BASE64] = &&base64,
        [OP_U64] = &&u64,       [OP_U32] = &&u32,         [OP_U16] = &&u16,     [OP_U8] = &&u8,
    };
    const struct row *r = kinds[kind].rows; /* ends with an OP_END row: its text ends the line */
    const uint8_t *f;
#define NEXT()                                                            \
    do {                                                                  \
        memcpy(p, r->prefix, 16); /* fixed size: one move; slack after */ \
        if (__builtin_expect(r->plen > 16, 0))                            \
            memcpy(p + 16, r->prefix + 16, PREFIX_MAX - 16);              \
        p += r->plen;                                                     \
        f = (const uint8_t *)rec + r->off;                                \
        goto *code[r->op];                                                \
    } while (0)
    NEXT();
/* clang-format off */
u64: {
        uint64_t v;
        memcpy(&v, f, 8);
        p = put_u64(p, v);
        r++;
        NEXT();
    }
u32: {
        uint32_t v;
        memcpy(&v, f, 4);
        p = put_u32(p, v);
        r++;
        NEXT();
    }
u16: {
        uint16_t v;
        memcpy(&v, f, 2);
        p = put_u32(p, v);
        r++;
        NEXT();
    }
u8:
    p = put_u32(p, *f);
    r++;
    NEXT();
text:
    p = put_text(p, f);
    r++;
    NEXT();
addr:
    p = put_addr(p, (unsigned)get_uint(rec, r->arg, r->arg_width), f);
    r++;
    NEXT();
family:
    p = put_family(p, (unsigned)get_uint(rec, r->off, r->width));
    r++;
    NEXT();
enumerated:
    p = put_enum(p, r->arg, get_uint(rec, r->off, r->width));
    r++;
    NEXT();
flags:
    p = put_flags(p, r->arg, get_uint(rec, r->off, r->width));
    r++;
    NEXT();
base64: {
        uint64_t n = get_uint(rec, r->arg, r->arg_width);
        *p++ = '"';
        p = put_base64(p, f, n < r->width ? (size_t)n : r->width);
        *p++ = '"';
        r++;
        NEXT();
    }
/* clang-format on */
lit:
    r++;
    NEXT();
end:
#undef NEXT
    return p;
}

/* Bytes one line of a kind can take at most, slack for the fixed-size copies
 * included: its rows' text, and each value at its widest (a u64 20 digits, a
 * task name 16 bytes each escaped to 6, an IPv6 address 45, ...). */
static size_t value_max(const struct row *r)
{
    switch (r->op) {
    case OP_UINT:
    case OP_U64:
    case OP_U32:
    case OP_U16:
    case OP_U8: return r->width == 8 ? 20 : 10;
    case OP_TEXT: return 2 + TEXT_BYTES * 6 + TEXT_BYTES;
    case OP_ADDR: return 2 + 45;
    case OP_FAMILY: return 2 + 10;
    case OP_ENUM: return enum_max[r->arg] > 2 + 20 ? enum_max[r->arg] : 2 + 20;
    case OP_FLAGS: return flags_max[r->arg];
    case OP_BASE64: return 2 + 4 * (((size_t)r->width + 2) / 3);
    default: return 0;
    }
}

size_t line_max(int kind)
{
    return kinds[kind].line_max;
}

size_t kind_size(int kind)
{
    return kinds[kind].size;
}

void kind_field(unsigned *off, unsigned *width)
{
    *off = kind_off, *width = kind_width;
}

/* ---- the calls ---------------------------------------------------------- */

/* Lines are formatted into a scratch buffer that is kept for the next call,
 * then copied into a bytes object of their exact size. Fresh memory for
 * every batch (a worst-case bytes object, shrunk after) costs a page fault
 * per 4 KiB written: a third of the time on eof records. One buffer is kept
 * (taken and given back atomically, so concurrent calls each get their own),
 * and only up to SCRATCH_KEEP bytes of address space: enough for the worst
 * case of a whole default chunk ring (16,384 records); only the pages a batch
 * wrote are resident (~13 MiB for 16,384 full chunks). */
#define SLACK        256 /* fixed-size copies (names, a task name) may write past a line's end */
#define SCRATCH_KEEP (32u << 20)
static struct scratch *_Atomic spare;

struct scratch *scratch_take(size_t need)
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

void scratch_give(struct scratch *s)
{
    if (s->cap > SCRATCH_KEEP) {
        free(s);
        return;
    }
    free(atomic_exchange(&spare, s));
}

/* 1 when kind names a record kind and init() has run; else 0 with an exception set. */
int kind_ready(int kind)
{
    if (!initialised) {
        PyErr_SetString(PyExc_RuntimeError, "_jsonl.init() was not called");
        return 0;
    }
    if (kind < 0 || kind >= nkinds || kinds[kind].size == 0) {
        PyErr_Format(PyExc_ValueError, "unknown record kind %d", kind);
        return 0;
    }
    return 1;
}

PyObject *jsonl_format(PyObject *self, PyObject *args)
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
    if (view.ndim != 1 || (size_t)view.itemsize != kinds[kind].size) {
        PyErr_Format(PyExc_ValueError, "records must be a 1-D array of %zu-byte items (got ndim %d, itemsize %zd)",
                     kinds[kind].size, view.ndim, view.itemsize);
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

static int load_enum(PyObject *seq, int t)
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
    memset(enums[t], 0, sizeof(enums[t]));
    enum_max[t] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast, i);
        if (o == Py_None)
            continue;
        if (!PyBytes_Check(o) || PyBytes_GET_SIZE(o) == 0 || PyBytes_GET_SIZE(o) >= NAME_MAX_) {
            PyErr_SetString(PyExc_ValueError, "a name must be bytes of 1..63 bytes, or None");
            Py_DECREF(fast);
            return -1;
        }
        enums[t][i].n = (uint8_t)PyBytes_GET_SIZE(o);
        memcpy(enums[t][i].s, PyBytes_AS_STRING(o), enums[t][i].n);
        if (enums[t][i].n > enum_max[t])
            enum_max[t] = enums[t][i].n;
    }
    Py_DECREF(fast);
    return 0;
}

static int load_flags(PyObject *seq, int t)
{
    PyObject *fast = PySequence_Fast(seq, "flags must be a sequence of (bit, name)");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > NFLAGS_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many flags");
        Py_DECREF(fast);
        return -1;
    }
    nflags[t] = 0;
    known_flags[t] = 0;
    flags_max[t] = 2 + 4 + 16 + 2; /* [ ] and ,"0x" + 16 hex digits + " */
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long bit;
        const char *s;
        Py_ssize_t len;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "Ky#", &bit, &s, &len)) {
            Py_DECREF(fast);
            return -1;
        }
        if (bit == 0 || (bit & (bit - 1)) || len <= 0 || len >= NAME_MAX_) {
            PyErr_SetString(PyExc_ValueError, "a flag is (one bit, a quoted name of 1..63 bytes)");
            Py_DECREF(fast);
            return -1;
        }
        flag_names[t][i].bit = bit;
        flag_names[t][i].n = (uint8_t)len;
        memcpy(flag_names[t][i].s, s, (size_t)len);
        known_flags[t] |= bit;
        flags_max[t] += (size_t)len + 1;
        nflags[t]++;
    }
    Py_DECREF(fast);
    return 0;
}

static int valid_width(unsigned w)
{
    return w == 1 || w == 2 || w == 4 || w == 8;
}

/* One kind: (record size, rows); a row is (prefix, op, offset, width, arg, arg_width). */
static int load_kind(PyObject *spec, struct kind *k)
{
    Py_ssize_t size;
    PyObject *rows;
    if (!PyArg_ParseTuple(spec, "nO", &size, &rows))
        return -1;
    PyObject *fast = PySequence_Fast(rows, "rows must be a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (size <= 0 || size > 65535 || n >= ROWS_MAX) {
        PyErr_Format(PyExc_ValueError, "a kind of %zd bytes with %zd rows: out of range", size, n);
        Py_DECREF(fast);
        return -1;
    }
    k->size = (size_t)size;
    k->nrows = 0;
    k->line_max = NAME_MAX_; /* slack for a fixed-size copy */
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *prefix;
        Py_ssize_t plen;
        int op;
        unsigned off, width, arg, arg_width;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "y#iIIII", &prefix, &plen, &op, &off, &width, &arg,
                              &arg_width)) {
            Py_DECREF(fast);
            return -1;
        }
        int fits = off + width <= (size_t)size;
        int ok = plen > 0 && plen < PREFIX_MAX && op >= 0 && op < NOPS;
        switch (op) {
        case OP_UINT:
        case OP_FAMILY: ok = ok && fits && valid_width(width); break;
        case OP_TEXT: ok = ok && fits && width == TEXT_BYTES; break;
        case OP_ADDR:
            ok = ok && fits && width == TEXT_BYTES && valid_width(arg_width) && arg + arg_width <= (size_t)size;
            break;
        case OP_ENUM: ok = ok && fits && valid_width(width) && (int)arg < nenums; break;
        case OP_FLAGS: ok = ok && fits && valid_width(width) && (int)arg < nflagtables; break;
        case OP_BASE64: ok = ok && fits && valid_width(arg_width) && arg + arg_width <= (size_t)size; break;
        default: break;
        }
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "row %zd of a %zd-byte kind: op %d at %u+%u (arg %u+%u) is not valid", i,
                         size, op, off, width, arg, arg_width);
            Py_DECREF(fast);
            return -1;
        }
        struct row *r = &k->rows[k->nrows++];
        memset(r, 0, sizeof(*r));
        r->op = (uint8_t)op, r->plen = (uint8_t)plen;
        r->off = (uint16_t)off, r->width = (uint16_t)width, r->arg = (uint16_t)arg, r->arg_width = (uint16_t)arg_width;
        memcpy(r->prefix, prefix, (size_t)plen);
        if (op == OP_UINT)
            r->op = width == 8 ? OP_U64 : width == 4 ? OP_U32 : width == 2 ? OP_U16 : OP_U8;
        k->line_max += (size_t)plen + value_max(r);
    }
    Py_DECREF(fast);
    /* The end: }\n, after the last row's text when that row is a literal. */
    struct row *last = k->nrows ? &k->rows[k->nrows - 1] : NULL;
    if (last != NULL && last->op == OP_LIT && last->plen + 2 < PREFIX_MAX) {
        last->op = OP_END;
    } else if (k->nrows < ROWS_MAX) {
        last = &k->rows[k->nrows++];
        memset(last, 0, sizeof(*last));
        last->op = OP_END;
    } else {
        PyErr_SetString(PyExc_ValueError, "too many rows");
        return -1;
    }
    memcpy(last->prefix + last->plen, "}\n", 2);
    last->plen += 2;
    k->line_max += 2;
    return 0;
}

PyObject *jsonl_init(PyObject *self, PyObject *args)
{
    PyObject *enum_tables, *flag_tables, *kind_specs;
    unsigned koff, kwidth;
    if (!PyArg_ParseTuple(args, "OOO(II):init", &enum_tables, &flag_tables, &kind_specs, &koff, &kwidth))
        return NULL;
    initialised = 0;
    nenums = nflagtables = nkinds = 0;
    memset(kinds, 0, sizeof(kinds));
    PyObject *e = PySequence_Fast(enum_tables, "enum tables must be a sequence");
    PyObject *f = PySequence_Fast(flag_tables, "flag tables must be a sequence");
    PyObject *k = PySequence_Fast(kind_specs, "kinds must be a sequence");
    int ok = e && f && k && PySequence_Fast_GET_SIZE(e) <= TABLES_MAX && PySequence_Fast_GET_SIZE(f) <= TABLES_MAX &&
             PySequence_Fast_GET_SIZE(k) <= KINDS_MAX;
    if (e && f && k && !ok)
        PyErr_SetString(PyExc_ValueError, "too many tables or kinds");
    if (ok && (!valid_width(kwidth) || koff > 64)) {
        PyErr_SetString(PyExc_ValueError, "kind_field: (offset, bytes) of an integer in the record header");
        ok = 0;
    }
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(e); i++, nenums++)
        ok = load_enum(PySequence_Fast_GET_ITEM(e, i), (int)i) == 0;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(f); i++, nflagtables++)
        ok = load_flags(PySequence_Fast_GET_ITEM(f, i), (int)i) == 0;
    for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(k); i++, nkinds++) {
        PyObject *spec = PySequence_Fast_GET_ITEM(k, i);
        if (spec == Py_None)
            continue; /* no kind has this number */
        ok = load_kind(spec, &kinds[i]) == 0;
        if (ok && kinds[i].size < koff + kwidth) {
            PyErr_Format(PyExc_ValueError, "kind %zd: %zu bytes do not hold the header", i, kinds[i].size);
            ok = 0;
        }
    }
    Py_XDECREF(e);
    Py_XDECREF(f);
    Py_XDECREF(k);
    if (!ok) {
        nkinds = 0;
        memset(kinds, 0, sizeof(kinds));
        return NULL;
    }
    kind_off = koff, kind_width = kwidth;
    initialised = 1;
    Py_RETURN_NONE;
}

PyObject *jsonl_line_max(PyObject *self, PyObject *args)
{
    int kind;
    if (!PyArg_ParseTuple(args, "i:line_max", &kind))
        return NULL;
    if (!kind_ready(kind))
        return NULL;
    return PyLong_FromSize_t(line_max(kind));
}

/* The writers' lookup tables, filled once when the module is imported. */
void writer_setup(void)
{
    for (int v = 0; v < 4096; v++) {
        B64_12[v][0] = B64[v >> 6];
        B64_12[v][1] = B64[v & 63];
    }
    for (int v = 0; v < 256; v++) {
        int n = snprintf(DEC8[v], 4, "%d", v);
        DEC8[v][3] = (char)n;
    }
}
