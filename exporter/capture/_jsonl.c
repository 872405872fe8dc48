/* exporter.capture._jsonl: the JSON lines of a whole batch of ring records in one call.
 *
 * nettap's only writer and ring reader (scan, below). It knows no record
 * kind: init() gives it, per kind, a table of rows (one per JSON key, in byte
 * order: the text before the value, the field's offset and width, how it is
 * written) and the name tables, which records.py builds from the field
 * tables generated from bpf/tcp.h (exporter/kernel/tcp_h.py). The pure-Python
 * writer in tests/oracles.py walks the same tables and is the reference it
 * is tested against: the same bytes, line for line (tests/unit/test_jsonl.py
 * checks the committed fixtures and thousands of random records).
 * format(kind, records) takes a 1-D numpy array of the ring's record dtype
 * (contiguous or strided, e.g. a field view of ring slots) and returns bytes:
 * every line, each ended by "\n". The loop runs without the interpreter
 * lock, so the ring-drain thread is never starved by formatting.
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

#define AF_INET_ 2
#define AF_INET6_ 10

/* ---- the tables init() is given -----------------------------------------
 * exporter/capture/records.py builds them from exporter/kernel/tcp_h.py, which
 * scripts/gen_layout.py generates from bpf/tcp.h and the object's BTF: per
 * record kind, one row per JSON key in byte order (the text before the value,
 * where the field is, how it is written), and the name tables. No record
 * layout is written here. */

#define TABLE_MAX 256            /* larger values are printed as numbers */
#define NAME_MAX_ 64             /* bytes of one quoted name */
#define TABLES_MAX 16
#define NFLAGS_MAX 32
#define KINDS_MAX 32
#define ROWS_MAX 48              /* an OP_END row included */
#define PREFIX_MAX 32            /* a row's text before its value: ,"key": (and a literal) */
#define TEXT_BYTES 16            /* a task name's array, and an address's */

typedef struct { uint8_t n; char s[NAME_MAX_]; } name_t;   /* n == 0: no name */
static name_t enums[TABLES_MAX][TABLE_MAX];
static size_t enum_max[TABLES_MAX];                       /* longest name */
static int nenums;

static struct { uint64_t bit; uint8_t n; char s[NAME_MAX_]; } flag_names[TABLES_MAX][NFLAGS_MAX];
static int nflags[TABLES_MAX];
static uint64_t known_flags[TABLES_MAX];
static size_t flags_max[TABLES_MAX];                      /* bytes of all names, commas, unknown bits */
static int nflagtables;

/* How a row's value is written (docs/records.md, "JSON forms"). */
enum { OP_LIT, OP_UINT, OP_TEXT, OP_ADDR, OP_FAMILY, OP_ENUM, OP_FLAGS, OP_BASE64, NOPS,
       OP_U64 = NOPS, OP_U32, OP_U16, OP_U8,            /* OP_UINT by width, chosen at init */
       OP_END };                                        /* the line's last text: a closing literal, }\n */

struct row {
    char prefix[PREFIX_MAX];     /* {"key": or ,"key": (OP_LIT: ,"type":"kind") */
    uint8_t op, plen;            /* plen: bytes of prefix */
    uint16_t off, width;         /* the field: offset, bytes */
    uint16_t arg, arg_width;     /* ADDR: the family field; BASE64: the length field (offset, bytes);
                                  * ENUM, FLAGS: the table */
} __attribute__((aligned(16)));
struct kind { size_t size, line_max; int nrows; struct row rows[ROWS_MAX]; };   /* size 0: no such kind */
static struct kind kinds[KINDS_MAX];          /* by kind number (NETTAP_KIND_*) */
static int nkinds;
static unsigned kind_off, kind_width;         /* where a record's header holds its kind number */

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
        uint64_t top = hi / 100000000;                     /* < 1845 */
        p = put_u32(p, (uint32_t)top);
        p = put_8digits(p, (uint32_t)(hi - top * 100000000));
    }
    return put_8digits(p, lo);
}


/* A name from a table ("name", quoted), or the value as a quoted number. */
static inline char *put_enum(char *p, int t, uint64_t v)
{
    if (v < TABLE_MAX && enums[t][v].n) {
        memcpy(p, enums[t][v].s, NAME_MAX_);               /* fixed size: inlined; slack after */
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
#define ONES 0x0101010101010101ull
#define HIGHS 0x8080808080808080ull
#define ZERO_BYTE(v) (((v) - ONES) & ~(v) & HIGHS)

/* Index of the first byte of s[0..16) that ends plain ASCII text (a NUL,
 * another control character, '"', '\\' or a byte >= 0x80), or 16: eight
 * bytes at a time. Each test flags that byte exactly, and may flag bytes
 * after it (borrows), so the lowest flag is the first such byte. */
static inline int first_special(const uint8_t *s)
{
    for (int h = 0; h < 16; h += 8) {
        uint64_t w;
        memcpy(&w, s + h, 8);
        uint64_t m = ((w - ONES * 0x20) & ~w & HIGHS) | (w & HIGHS) | ZERO_BYTE(w ^ (ONES * '"')) |
                     ZERO_BYTE(w ^ (ONES * '\\'));
        if (m)
            return h + (__builtin_ctzll(m) >> 3);
    }
    return 16;
}

static inline char *put_text(char *p, const uint8_t *s)
{
    int i = first_special(s);
    *p++ = '"';
    memcpy(p, s, 16);                      /* the plain-ASCII start; the buffer has room */
    p += i;
    if (i < 16 && s[i]) {                  /* not the NUL ending it: escapes, UTF-8 */
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
    if (rest) {                                /* unknown bits: "0x.." as Python's {:#x} */
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

static inline uint64_t get_uint(const char *rec, unsigned off, unsigned width)
{
    switch (width) {
    case 8: { uint64_t v; memcpy(&v, rec + off, 8); return v; }
    case 4: { uint32_t v; memcpy(&v, rec + off, 4); return v; }
    case 2: { uint16_t v; memcpy(&v, rec + off, 2); return v; }
    default: return (uint8_t)rec[off];
    }
}

/* One record's line at p; returns the end of what it wrote. Threaded: each
 * value's code copies the next row's text and jumps to that row's code
 * itself, so every jump is predicted on its own (a kind's rows repeat the
 * same sequence record after record) and a line costs about what straight
 * code written for the kind did (bench/writer.py --against). */
static inline char *format_one(int kind, char *p, const char *rec)
{
    static const void *const code[] = {
        [OP_END] = &&end, [OP_LIT] = &&lit, [OP_TEXT] = &&text, [OP_ADDR] = &&addr, [OP_FAMILY] = &&family,
        [OP_ENUM] = &&enumerated, [OP_FLAGS] = &&flags, [OP_BASE64] = &&base64,
        [OP_U64] = &&u64, [OP_U32] = &&u32, [OP_U16] = &&u16, [OP_U8] = &&u8,
    };
    const struct row *r = kinds[kind].rows;      /* ends with an OP_END row: its text ends the line */
    const uint8_t *f;
#define NEXT()                                                                   \
    do {                                                                         \
        memcpy(p, r->prefix, 16);           /* fixed size: one move; slack after */ \
        if (__builtin_expect(r->plen > 16, 0))                                   \
            memcpy(p + 16, r->prefix + 16, PREFIX_MAX - 16);                     \
        p += r->plen;                                                            \
        f = (const uint8_t *)rec + r->off;                                       \
        goto *code[r->op];                                                       \
    } while (0)
    NEXT();
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
    case OP_UINT: case OP_U64: case OP_U32: case OP_U16: case OP_U8: return r->width == 8 ? 20 : 10;
    case OP_TEXT: return 2 + TEXT_BYTES * 6 + TEXT_BYTES;
    case OP_ADDR: return 2 + 45;
    case OP_FAMILY: return 2 + 10;
    case OP_ENUM: return enum_max[r->arg] > 2 + 20 ? enum_max[r->arg] : 2 + 20;
    case OP_FLAGS: return flags_max[r->arg];
    case OP_BASE64: return 2 + 4 * (((size_t)r->width + 2) / 3);
    default: return 0;
    }
}

static inline size_t line_max(int kind) { return kinds[kind].line_max; }

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
    if (kind < 0 || kind >= nkinds || kinds[kind].size == 0) {
        PyErr_Format(PyExc_ValueError, "unknown record kind %d", kind);
        return 0;
    }
    return 1;
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

/* scan(kinds, data, start, avail, max_records, mode[, counts]) -> (bytes or None, consumed, kept, bad, stop)
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
 * A record whose body crosses the end of the area is copied whole first. */
#define RB_BUSY_ (1u << 31)
#define RB_DISCARD_ (1u << 30)
#define RB_HDR_ 8
#define RECORD_MAX 4096

enum { SCAN_COUNT, SCAN_LINES, SCAN_COPY };

static PyObject *jsonl_scan(PyObject *self, PyObject *args)
{
    int mode;
    unsigned long long mask;
    PyObject *obj, *counts_obj = NULL;
    Py_ssize_t start, avail, max_records;
    if (!PyArg_ParseTuple(args, "KOnnni|O:scan", &mask, &obj, &start, &avail, &max_records, &mode, &counts_obj))
        return NULL;
    /* The kinds the ring carries: the shortest step a kept record takes, the
     * most output one can give. */
    size_t step_min = SIZE_MAX, each_max = 0, rsize_max = 0;
    int nmask = 0;
    for (int k = 0; k < KINDS_MAX; k++) {
        if (!(mask >> k & 1))
            continue;
        if (!kind_ready(k))
            return NULL;
        size_t step = (RB_HDR_ + kinds[k].size + 7) & ~(size_t)7;
        size_t each = mode == SCAN_LINES ? line_max(k) : mode == SCAN_COPY ? kinds[k].size : 0;
        step_min = step < step_min ? step : step_min;
        each_max = each > each_max ? each : each_max;
        rsize_max = kinds[k].size > rsize_max ? kinds[k].size : rsize_max;
        nmask++;
    }
    if (nmask == 0 || (mask >> KINDS_MAX) || (mode == SCAN_COPY && nmask != 1)) {
        PyErr_Format(PyExc_ValueError, "scan: kinds 0x%llx: one kind or more (one to copy)", mask);
        return NULL;
    }
    Py_buffer cview = {0};
    uint64_t *counts = NULL;
    if (counts_obj != NULL && counts_obj != Py_None) {
        if (PyObject_GetBuffer(counts_obj, &cview, PyBUF_WRITABLE) < 0)
            return NULL;
        if (cview.len != KINDS_MAX * (Py_ssize_t)sizeof(uint64_t) || (uintptr_t)cview.buf % 8) {
            PyErr_Format(PyExc_ValueError, "scan: counts of %zd bytes, not %d aligned uint64", cview.len, KINDS_MAX);
            PyBuffer_Release(&cview);
            return NULL;
        }
        counts = cview.buf;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) {
        if (counts)
            PyBuffer_Release(&cview);
        return NULL;
    }
    Py_ssize_t size = view.len;
    if (size < (Py_ssize_t)step_min || (size & (size - 1)) || start < 0 || start >= size || start % 8 ||
        avail < 0 || max_records < 0 || mode < SCAN_COUNT || mode > SCAN_COPY || rsize_max > RECORD_MAX) {
        PyErr_Format(PyExc_ValueError, "scan: bad geometry (size %zd, start %zd, avail %zd, max %zd, mode %d)",
                     size, start, avail, max_records, mode);
        PyBuffer_Release(&view);
        if (counts)
            PyBuffer_Release(&cview);
        return NULL;
    }
    if (avail > size)
        avail = size;
    /* The output's bound: each kept record consumed at least step_min bytes of avail. */
    Py_ssize_t most = avail / (Py_ssize_t)step_min;
    if (most > max_records)
        most = max_records;
    struct scratch *buf = NULL;
    Py_ssize_t consumed = 0, kept = 0, bad = 0, seen = 0;
    int stop = 0, nomem = 0;
    const char *data = view.buf;
    size_t mask_area = (size_t)size - 1;
    char *p = NULL;
    char whole[RECORD_MAX];
    Py_BEGIN_ALLOW_THREADS
    if (each_max && most) {
        buf = scratch_take((size_t)most * each_max);
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
        size_t off = ((size_t)start + (size_t)consumed) & mask_area;
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
        if (len > rsize_max || len < kind_off + kind_width) {   /* no kind of this ring is that long */
            bad++;
            continue;
        }
        size_t body = (off + RB_HDR_) & mask_area;
        const char *rec = data + body;
        if (body + len > (size_t)size) {                /* crosses the end: copy it whole */
            size_t first = (size_t)size - body;
            memcpy(whole, data + body, first);
            memcpy(whole + first, data, len - first);
            rec = whole;
        }
        uint64_t k = get_uint(rec, kind_off, kind_width);
        if (k >= KINDS_MAX || !(mask >> k & 1) || len != kinds[k].size) {
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
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (counts)
        PyBuffer_Release(&cview);
    if (nomem)
        return PyErr_NoMemory();
    PyObject *out = Py_None;
    Py_INCREF(Py_None);
    if (each_max) {
        Py_DECREF(Py_None);
        out = PyBytes_FromStringAndSize(buf != NULL ? buf->data : "", buf != NULL ? (Py_ssize_t)(p - buf->data) : 0);
        if (buf != NULL)
            scratch_give(buf);
        if (out == NULL)
            return NULL;
    }
    return Py_BuildValue("(Nnnni)", out, consumed, kept, bad, stop);
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
    flags_max[t] = 2 + 4 + 16 + 2;                      /* [ ] and ,"0x" + 16 hex digits + " */
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

static int valid_width(unsigned w) { return w == 1 || w == 2 || w == 4 || w == 8; }

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
    k->line_max = NAME_MAX_;                           /* slack for a fixed-size copy */
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *prefix;
        Py_ssize_t plen;
        int op;
        unsigned off, width, arg, arg_width;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "y#iIIII", &prefix, &plen, &op, &off, &width,
                              &arg, &arg_width)) {
            Py_DECREF(fast);
            return -1;
        }
        int fits = off + width <= (size_t)size;
        int ok = plen > 0 && plen < PREFIX_MAX && op >= 0 && op < NOPS;
        switch (op) {
        case OP_UINT: case OP_FAMILY: ok = ok && fits && valid_width(width); break;
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
            PyErr_Format(PyExc_ValueError, "row %zd of a %zd-byte kind: op %d at %u+%u (arg %u+%u) is not valid",
                         i, size, op, off, width, arg, arg_width);
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

static PyObject *jsonl_init(PyObject *self, PyObject *args)
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
            continue;                                   /* no kind has this number */
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

static PyObject *jsonl_line_max(PyObject *self, PyObject *args)
{
    int kind;
    if (!PyArg_ParseTuple(args, "i:line_max", &kind))
        return NULL;
    if (!kind_ready(kind))
        return NULL;
    return PyLong_FromSize_t(line_max(kind));
}

/* ---- kind_split: what nettap ingest sends ---------------------------------
 * A region of a capture file (complete lines) as one payload per record
 * kind: every line this writer makes holds its kind, `"type":"KIND"` (keys in
 * byte order, so "type" is one of a record's last keys: only an owner's "via"
 * comes after it). A ring's records come in runs, but the obs_events ring
 * mixes its kinds a few lines at a time, so the lines are gathered here, not
 * in Python (~1 us a run there). Returns [(kind, payload, lines)] in the
 * order the kinds first appear, payload None when the region holds one kind
 * (it is its own payload); or None when a line has no kind (a line that is
 * not a record, a last line without its newline) or the region has more than
 * SPLIT_KINDS_MAX kinds: exporter/ingest/batches.py then goes line by line, with the
 * same rule. */

#define KIND_MAX 32

static int kind_char(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

/* The kind of line [s, e) (e just past its '\n'): its start and length, or
 * -1. The key is the last `"type":"` that a kind of 1 to KIND_MAX
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
        while (k < e && kind_char(*k) && k - b <= KIND_MAX)
            k++;
        if (k == b || k - b > KIND_MAX || k + 1 >= e || k[0] != '"' || (k[1] != ',' && k[1] != '}'))
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
    char *w;                /* where its next lines go, in its payload */
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

static PyObject *jsonl_kind_split(PyObject *self, PyObject *args)
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
    {"format", jsonl_format, METH_VARARGS,
     "format(kind, records) -> bytes: one JSON line per record of an init() kind, "
     "each ended by a newline; runs without the GIL."},
    {"init", jsonl_init, METH_VARARGS,
     "init(enum_tables, flag_tables, kinds, kind_field): the name tables (quoted bytes or None per value; "
     "flags as (bit, quoted name)), per kind number (record size, rows (prefix, op, offset, width, arg, "
     "arg_width)) or None, and (offset, bytes) of the kind number in every record's header."},
    {"scan", jsonl_scan, METH_VARARGS,
     "scan(kinds, data, start, avail, max_records, mode[, counts]) -> (bytes or None, consumed, kept, bad, stop): "
     "one pass over a ring's committed records of the kinds in the mask (mode 0 count, 1 JSON lines, "
     "2 copies); runs without the GIL."},
    {"kind_split", jsonl_kind_split, METH_VARARGS,
     "kind_split(data) -> [(kind, payload, lines)]: data's complete lines gathered by record kind (a line's "
     "last \"type\" key), payload None when there is one kind; None when a line has no kind or no newline, "
     "or there are more than 16 kinds."},
    {"line_max", jsonl_line_max, METH_VARARGS,
     "line_max(kind) -> the longest line (newline included) a record of that kind can give."},
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
