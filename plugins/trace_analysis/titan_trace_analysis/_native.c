/* The map step's hot loops in C, each equal to a Python loop that stays as the fallback (no
 * compiler at install) and as the reference the tests compare it with:
 *   scan          reader.TraceReader._parse: events of the traceEvents text
 *   take          ops.OpBuilder.batch: GPU events into Ops
 *   union_any     intervals.union: sorted() + intervals.union_sorted (+ intervals.clip)
 *   overlap       intervals.overlap
 *   gaps          bubble._gaps_py
 *   assign        steps.assign_py
 *
 * scan cuts the decompressed text into events, keeps the wanted ones, reads launch calls and
 * parses GPU events into their fields, exactly as the Python loop in reader.py does:
 * - events are cut at the same ``}\s*,\s*{`` boundaries (a bytes regex's \s), the last HOLD
 *   pieces of a buffer are held back the same way;
 * - the selection, launch and annotation tests are hand-written equivalents of reader.py's
 *   regexes (the same leftmost match, the same captured text);
 * - a GPU event becomes a tuple of its fields only when this parser can vouch that orjson would
 *   give the same values: strict JSON, ASCII, no escapes in the fields read, integers of at most
 *   18 digits, no exponent that could overflow; anything else is handed back as the raw piece,
 *   and Python parses it as before.  So is an event Python drops (drops.check: a ts or dur out
 *   of range, no integer pid and tid; a piece longer than the per-string limit, which Python
 *   searches for an over-long string): Python counts each drop with its reason.
 * Where Python would raise, drop or retry (a launch time float() rejects or that is out of
 * range, a piece whose parse fails and needs its neighbours), scan() returns None and reader.py
 * runs the Python loop over the whole buffer again: same results by construction (launch
 * records are idempotent, and this scan counts no drop).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static PyObject *CAT_KERNEL, *CAT_MEMCPY, *CAT_MEMSET, *EMPTY, *CAT_KEY;

#define MAX_DEPTH 64
#define MAX_INT_DIGITS 18 /* fits int64: no rounding question, orjson gives an int */
#define MAX_NUMBER 96

/* \s of a bytes regex: space, \t \n \v \f \r */
static inline int re_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static inline int json_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static inline int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

static const char *skip_re_space(const char *p, const char *e) {
    while (p < e && re_space((unsigned char)*p)) p++;
    return p;
}

/* The first `lit` (length len) in [p, e), found by memchr on its byte k (a rare one: glibc's
 * memmem costs more to start than these short searches take), or NULL. */
static const char *find(const char *p, const char *e, const char *lit, Py_ssize_t len, Py_ssize_t k) {
    if (e - p < len) return NULL;
    const char *q = p + k;
    while (q < e - (len - 1 - k) && (q = memchr(q, lit[k], (size_t)(e - (len - 1 - k) - q))) != NULL) {
        /* the first and last bytes first: most hits of a common byte fail there */
        if (q[-k] == lit[0] && q[len - 1 - k] == lit[len - 1] && memcmp(q - k, lit, (size_t)len) == 0)
            return q - k;
        q++;
    }
    return NULL;
}
#define FIND(p, e, lit, k) find((p), (e), (lit), (Py_ssize_t)sizeof(lit) - 1, (k))

/* p[0:n] contains the literal entirely within its first `within` bytes (bytes.find(x, 0, within)) */
#define FIND_WITHIN(p, n, lit, k, within) (FIND((p), (p) + ((n) < (within) ? (n) : (within)), (lit), (k)) != NULL)

/* `"<key>"\s*:\s*"` at q: the position after the opening quote of the value, or NULL */
static const char *key_then_quote(const char *q, const char *e, Py_ssize_t keylen) {
    const char *r = skip_re_space(q + keylen, e);
    if (r >= e || *r != ':') return NULL;
    r = skip_re_space(r + 1, e);
    if (r >= e || *r != '"') return NULL;
    return r + 1;
}

/* bytes a string holds as they are: not '"', '\\', a control byte or non-ASCII */
static unsigned char PLAIN[256];

static void init_plain(void) {
    for (int c = 0x20; c < 0x80; c++) PLAIN[c] = c != '"' && c != '\\';
}

#if defined(__SSE2__) && !defined(TITAN_SCAN_SCALAR) /* the scalar code: other CPUs, and tests */
#include <emmintrin.h>
/* The first `"c` pair in [p, e - 1), 16 positions per step: far rarer than 'c' alone (a
 * memchr on 'c' stops about every 40 bytes of a trace), so `"cat"` is found with few stops. */
static const char *find_quote_c(const char *p, const char *e) {
    const __m128i quote = _mm_set1_epi8('"'), c = _mm_set1_epi8('c');
    while (e - p >= 17) {
        __m128i a = _mm_loadu_si128((const __m128i *)p);
        __m128i b = _mm_loadu_si128((const __m128i *)(p + 1));
        int m = _mm_movemask_epi8(_mm_and_si128(_mm_cmpeq_epi8(a, quote), _mm_cmpeq_epi8(b, c)));
        if (m) return p + __builtin_ctz((unsigned)m);
        p += 16;
    }
    for (; p + 1 < e; p++)
        if (p[0] == '"' && p[1] == 'c') return p;
    return NULL;
}

/* the first byte of [p, e) that is not PLAIN (a string's quote, backslash, control or
 * non-ASCII byte), 16 bytes per step; e when none */
static const char *skip_plain(const char *p, const char *e) {
    const __m128i quote = _mm_set1_epi8('"'), slash = _mm_set1_epi8('\\');
    const __m128i space = _mm_set1_epi8(0x20); /* signed: bytes >= 0x80 are below it too */
    while (e - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        __m128i bad = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, slash)),
                                   _mm_cmpgt_epi8(space, v));
        int m = _mm_movemask_epi8(bad);
        if (m) return p + __builtin_ctz((unsigned)m);
        p += 16;
    }
    while (p < e && PLAIN[(unsigned char)*p]) p++;
    return p;
}
#else
static const char *find_quote_c(const char *p, const char *e) {
    for (; p + 1 < e; p++) {
        p = memchr(p, '"', (size_t)(e - p - 1));
        if (p == NULL) return NULL;
        if (p[1] == 'c') return p;
    }
    return NULL;
}

static const char *skip_plain(const char *p, const char *e) {
    while (p < e && PLAIN[(unsigned char)*p]) p++;
    return p;
}
#endif

/* the first `"cat"` in [p, e) */
static const char *find_cat(const char *p, const char *e) {
    while ((p = find_quote_c(p, e)) != NULL) {
        if (e - p >= 5 && p[2] == 'a' && p[3] == 't' && p[4] == '"') return p;
        p++;
    }
    return NULL;
}

static const char *const WANTED[] = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime",
                                     "cuda_driver", "musa_runtime", "musa_driver",
                                     "user_annotation"};

/* reader.WANTED.search */
static int wanted(const char *p, const char *e) {
    const char *q = p;
    while ((q = find_cat(q, e)) != NULL) {
        const char *r = key_then_quote(q, e, 5);
        if (r != NULL) {
            for (size_t i = 0; i < sizeof(WANTED) / sizeof(WANTED[0]); i++) {
                Py_ssize_t len = (Py_ssize_t)strlen(WANTED[i]);
                if (e - r > len && memcmp(r, WANTED[i], (size_t)len) == 0 && r[len] == '"') return 1;
            }
        }
        q++;
    }
    return 0;
}

static const char *const COMM[] = {"nccl:", "gloo:", "mccl:", "rccl:", "hccl:", "titan.p2p:"};

/* reader.COMM_MARK.search */
static int comm_mark(const char *p, const char *e) {
    const char *q = p;
    while ((q = FIND(q, e, "\"name\"", 4)) != NULL) {
        const char *r = key_then_quote(q, e, 6);
        if (r != NULL) {
            for (size_t i = 0; i < sizeof(COMM) / sizeof(COMM[0]); i++) {
                Py_ssize_t len = (Py_ssize_t)strlen(COMM[i]);
                if (e - r >= len && memcmp(r, COMM[i], (size_t)len) == 0) return 1;
            }
        }
        q++;
    }
    return 0;
}

typedef struct {
    const char *s, *e;
} span;

static inline int float_char(unsigned char c) {
    return is_digit(c) || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-';
}

/* reader.LAUNCH.search: "tid"\s*:\s*(\d+)\s*,\s*"ts"\s*:\s*(-?[0-9][0-9.eE+-]*)[^{]*\{[^}]*
 * "correlation"\s*:\s*(\d+).  Every quantifier but the last [^}]* is deterministic here (the
 * next token cannot be taken by it); that one backtracks from the first '}' after the '{', so
 * the match is the last "correlation" before it that is followed by \s*:\s*\d. */
static int launch_match(const char *p, const char *e, span *tid, span *ts, span *corr) {
    const char *q = p;
    while ((q = FIND(q, e, "\"tid\"", 3)) != NULL) {
        const char *r = skip_re_space(q + 5, e);
        q++;
        if (r >= e || *r != ':') continue;
        r = skip_re_space(r + 1, e);
        tid->s = r;
        while (r < e && is_digit((unsigned char)*r)) r++;
        if (r == tid->s) continue;
        tid->e = r;
        r = skip_re_space(r, e);
        if (r >= e || *r != ',') continue;
        r = skip_re_space(r + 1, e);
        if (e - r < 4 || memcmp(r, "\"ts\"", 4) != 0) continue;
        r = skip_re_space(r + 4, e);
        if (r >= e || *r != ':') continue;
        r = skip_re_space(r + 1, e);
        ts->s = r;
        if (r < e && *r == '-') r++;
        if (r >= e || !is_digit((unsigned char)*r)) continue;
        while (r < e && float_char((unsigned char)*r)) r++;
        ts->e = r;
        const char *brace = memchr(r, '{', (size_t)(e - r));
        if (brace == NULL) continue;
        const char *close = memchr(brace + 1, '}', (size_t)(e - brace - 1));
        if (close == NULL) close = e;
        int found = 0;
        const char *c = brace + 1;
        while ((c = FIND(c, close, "\"correlation\"", 7)) != NULL) {
            const char *v = skip_re_space(c + 13, e);
            c++;
            if (v >= e || *v != ':') continue;
            v = skip_re_space(v + 1, e);
            const char *d = v;
            while (d < e && is_digit((unsigned char)*d)) d++;
            if (d == v) continue;
            corr->s = v;
            corr->e = d;
            found = 1;
        }
        if (found) return 1;
    }
    return 0;
}

/* int(digits) for at most 18 digits; -1 when longer (the caller falls back) */
static long long small_int(span s) {
    if (s.e - s.s > MAX_INT_DIGITS) return -1;
    long long v = 0;
    for (const char *c = s.s; c < s.e; c++) v = v * 10 + (*c - '0');
    return v;
}

/* float(text) as Python computes it; 0 when Python's float() would not take the whole text */
static int py_float(span s, double *out) {
    char tmp[MAX_NUMBER + 1];
    Py_ssize_t n = s.e - s.s;
    if (n <= 0 || n > MAX_NUMBER) return 0;
    memcpy(tmp, s.s, (size_t)n);
    tmp[n] = '\0';
    char *end = NULL;
    double v = PyOS_string_to_double(tmp, &end, NULL);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (end != tmp + n) return 0;
    *out = v;
    return 1;
}

/* ---- a strict JSON parser that records the few fields the analysis reads ---- */

enum { J_NONE, J_STR, J_INT, J_FLOAT, J_OBJ, J_OTHER };
enum { P_OK, P_RAW }; /* P_RAW: not provably what orjson returns; Python parses the piece */

typedef struct {
    int type;
    int escaped; /* a string with a backslash escape */
    const char *s, *e; /* a string's content without quotes; a number's or object's text */
} jval;

typedef struct {
    const char *p, *e;
    jval cat, name, ts, dur, args, corr, pid, tid;
} parser;

/* what a GPU event must satisfy to become a tuple (drops.check; the rest goes to Python) */
typedef struct {
    double max_ts, max_dur;
    Py_ssize_t max_string;
} limits;

static inline void skip_ws(parser *ps) {
    while (ps->p < ps->e && json_ws((unsigned char)*ps->p)) ps->p++;
}

static inline int hexval(unsigned char c) {
    if (is_digit(c)) return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* at the opening quote */
static int parse_string(parser *ps, jval *v) {
    const char *p = ps->p + 1, *e = ps->e;
    v->type = J_STR;
    v->escaped = 0;
    v->s = p;
    for (;;) {
        p = skip_plain(p, e); /* the common bytes, 16 at a time */
        if (p >= e) return P_RAW;
        unsigned char c = (unsigned char)*p;
        if (c == '"') break;
        if (c < 0x20 || c >= 0x80) return P_RAW; /* invalid, or UTF-8 left to orjson */
        if (c == '\\') {
            v->escaped = 1;
            if (p + 1 >= e) return P_RAW;
            unsigned char x = (unsigned char)p[1];
            if (x == 'u') {
                if (e - p < 6) return P_RAW;
                int cp = 0;
                for (int i = 2; i < 6; i++) {
                    int h = hexval((unsigned char)p[i]);
                    if (h < 0) return P_RAW;
                    cp = cp * 16 + h;
                }
                if (cp >= 0xD800 && cp <= 0xDFFF) return P_RAW; /* surrogates: orjson decides */
                p += 6;
                continue;
            }
            if (!strchr("\"\\/bfnrt", x) || x == '\0') return P_RAW;
            p += 2;
            continue;
        }
        p++;
    }
    v->e = p;
    ps->p = p + 1;
    return P_OK;
}

static int parse_number(parser *ps, jval *v) {
    const char *p = ps->p, *e = ps->e;
    v->s = p;
    if (p < e && *p == '-') p++;
    const char *d0 = p;
    if (p >= e || !is_digit((unsigned char)*p)) return P_RAW;
    if (*p == '0') {
        p++;
        if (p < e && is_digit((unsigned char)*p)) return P_RAW; /* leading zero */
    } else {
        while (p < e && is_digit((unsigned char)*p)) p++;
    }
    Py_ssize_t int_digits = p - d0;
    int is_float = 0;
    if (p < e && *p == '.') {
        is_float = 1;
        p++;
        const char *f0 = p;
        while (p < e && is_digit((unsigned char)*p)) p++;
        if (p == f0) return P_RAW;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        is_float = 1;
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        const char *x0 = p;
        while (p < e && is_digit((unsigned char)*p)) p++;
        if (p == x0) return P_RAW;
        if (p - x0 > 2) return P_RAW; /* |exponent| >= 100: overflow is orjson's to judge */
    }
    if (int_digits > MAX_INT_DIGITS) return P_RAW; /* big integers become floats in orjson */
    if (is_float && p - v->s > MAX_NUMBER) return P_RAW;
    v->type = is_float ? J_FLOAT : J_INT;
    v->e = p;
    ps->p = p;
    return P_OK;
}

static int parse_value(parser *ps, jval *v, int depth, int role);

enum { ROLE_NONE, ROLE_TOP, ROLE_ARGS };

/* at '{' (or, for the event itself, at its first member: the braces are the separators) */
static int parse_members(parser *ps, int depth, int role, int braced) {
    skip_ws(ps);
    if (braced && ps->p < ps->e && *ps->p == '}') {
        ps->p++;
        return P_OK;
    }
    if (!braced && ps->p >= ps->e) return P_OK; /* "{}" */
    for (;;) {
        if (ps->p >= ps->e || *ps->p != '"') return P_RAW;
        jval key, val;
        if (parse_string(ps, &key) != P_OK) return P_RAW;
        skip_ws(ps);
        if (ps->p >= ps->e || *ps->p != ':') return P_RAW;
        ps->p++;
        skip_ws(ps);
        jval *slot = NULL;
        int child_role = ROLE_NONE;
        if (role != ROLE_NONE && key.escaped) return P_RAW; /* could spell a field we read */
        Py_ssize_t klen = key.e - key.s;
        if (role == ROLE_TOP) {
            if (klen == 3 && memcmp(key.s, "cat", 3) == 0) slot = &ps->cat;
            else if (klen == 4 && memcmp(key.s, "name", 4) == 0) slot = &ps->name;
            else if (klen == 2 && memcmp(key.s, "ts", 2) == 0) slot = &ps->ts;
            else if (klen == 3 && memcmp(key.s, "dur", 3) == 0) slot = &ps->dur;
            else if (klen == 3 && memcmp(key.s, "pid", 3) == 0) slot = &ps->pid;
            else if (klen == 3 && memcmp(key.s, "tid", 3) == 0) slot = &ps->tid;
            else if (klen == 4 && memcmp(key.s, "args", 4) == 0) {
                slot = &ps->args;
                child_role = ROLE_ARGS;
            }
        } else if (role == ROLE_ARGS && klen == 11 && memcmp(key.s, "correlation", 11) == 0) {
            slot = &ps->corr;
        }
        if (child_role == ROLE_ARGS) ps->corr.type = J_NONE; /* a later "args" replaces it */
        if (parse_value(ps, &val, depth + 1, child_role) != P_OK) return P_RAW;
        if (slot != NULL) *slot = val; /* the last of duplicate keys wins, as in orjson */
        skip_ws(ps);
        if (ps->p >= ps->e) return braced ? P_RAW : P_OK;
        if (*ps->p == ',') {
            ps->p++;
            skip_ws(ps);
            continue;
        }
        if (braced && *ps->p == '}') {
            ps->p++;
            return P_OK;
        }
        return P_RAW;
    }
}

static int parse_value(parser *ps, jval *v, int depth, int role) {
    if (depth > MAX_DEPTH || ps->p >= ps->e) return P_RAW;
    const char *start = ps->p;
    unsigned char c = (unsigned char)*ps->p;
    v->escaped = 0;
    if (c == '"') return parse_string(ps, v);
    if (c == '-' || is_digit(c)) return parse_number(ps, v);
    v->s = start;
    if (c == '{') {
        ps->p++;
        if (parse_members(ps, depth, role == ROLE_ARGS ? ROLE_ARGS : ROLE_NONE, 1) != P_OK) return P_RAW;
        v->type = J_OBJ;
        v->e = ps->p;
        return P_OK;
    }
    if (c == '[') {
        ps->p++;
        skip_ws(ps);
        if (ps->p < ps->e && *ps->p == ']') {
            ps->p++;
        } else {
            for (;;) {
                jval item;
                if (parse_value(ps, &item, depth + 1, ROLE_NONE) != P_OK) return P_RAW;
                skip_ws(ps);
                if (ps->p >= ps->e) return P_RAW;
                if (*ps->p == ',') {
                    ps->p++;
                    skip_ws(ps);
                    continue;
                }
                if (*ps->p == ']') {
                    ps->p++;
                    break;
                }
                return P_RAW;
            }
        }
        v->type = J_OTHER;
        v->e = ps->p;
        return P_OK;
    }
    static const char *const LITERALS[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t len = strlen(LITERALS[i]);
        if ((size_t)(ps->e - ps->p) >= len && memcmp(ps->p, LITERALS[i], len) == 0) {
            ps->p += len;
            v->type = J_OTHER;
            v->e = ps->p;
            return P_OK;
        }
    }
    return P_RAW;
}

/* a JSON number's value as Python's float(orjson value) */
static int number_value(const jval *v, double *out) {
    if (v->type == J_INT) {
        const char *s = v->s;
        int neg = *s == '-';
        long long n = small_int((span){s + neg, v->e});
        *out = (double)(neg ? -n : n); /* -0 is the int 0 in orjson, so 0.0 */
        return 1;
    }
    if (v->type == J_FLOAT) return py_float((span){v->s, v->e}, out);
    return 0;
}

/* Kernel names as str, reused: a rank launches ~30k kernels under a few hundred names of up to
 * ~1 KB each. Handing out one str per name spares a decode and a free per kernel, and the op
 * builder's dict lookups by name then match by identity (no siphash, no memcmp of the name).
 * A direct-mapped cache of NAME_SLOTS names up to NAME_BYTES bytes (~2 MB at most), per process;
 * the GIL guards it. */
#define NAME_SLOTS 1024
#define NAME_BYTES 2048
static struct {
    uint64_t h;
    PyObject *s;
} NAMES[NAME_SLOTS];

static PyObject *name_str(const char *s, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n, w;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) { /* 8 bytes a step: the names are long */
        memcpy(&w, s + i, 8);
        h = (h ^ w) * 0x100000001B3ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001B3ULL;
    int cached = n <= NAME_BYTES;
    size_t at = (size_t)(h ^ (h >> 32)) & (NAME_SLOTS - 1);
    PyObject *hit = NAMES[at].s;
    if (cached && hit != NULL && NAMES[at].h == h && PyUnicode_GET_LENGTH(hit) == n &&
        memcmp(PyUnicode_DATA(hit), s, (size_t)n) == 0) {
        Py_INCREF(hit);
        return hit;
    }
    PyObject *str = PyUnicode_DecodeASCII(s, n, NULL);
    if (str != NULL && cached && PyUnicode_IS_COMPACT_ASCII(str)) {
        Py_INCREF(str);
        NAMES[at].h = h;
        Py_XSETREF(NAMES[at].s, str); /* the name it replaces is released */
    }
    return str;
}

/* The fields of one GPU event: (cat, ts, dur, name, corr, args JSON bytes or None), as
 * ops.OpBuilder.gpu_event would take them from orjson's dict; Py_None when this parser cannot
 * vouch for that (Python parses the piece); NULL on a Python error. */
static PyObject *gpu_fields(const char *p, const char *e, const limits *lim) {
    parser ps;
    if (e - p > lim->max_string) Py_RETURN_NONE; /* Python looks for an over-long string */
    memset(&ps, 0, sizeof(ps));
    ps.p = p;
    ps.e = e;
    if (parse_members(&ps, 0, ROLE_TOP, 0) != P_OK) Py_RETURN_NONE;
    if (ps.cat.type != J_STR || ps.cat.escaped) Py_RETURN_NONE;
    PyObject *cat;
    Py_ssize_t clen = ps.cat.e - ps.cat.s;
    if (clen == 6 && memcmp(ps.cat.s, "kernel", 6) == 0) cat = CAT_KERNEL;
    else if (clen == 10 && memcmp(ps.cat.s, "gpu_memcpy", 10) == 0) cat = CAT_MEMCPY;
    else if (clen == 10 && memcmp(ps.cat.s, "gpu_memset", 10) == 0) cat = CAT_MEMSET;
    else Py_RETURN_NONE;
    double ts, dur = 0.0;
    if (!number_value(&ps.ts, &ts)) Py_RETURN_NONE;
    if (ps.dur.type != J_NONE && !number_value(&ps.dur, &dur)) Py_RETURN_NONE;
    if (ps.name.type != J_NONE && (ps.name.type != J_STR || ps.name.escaped)) Py_RETURN_NONE;
    /* Python drops these and says why; NaN cannot come from this parser */
    if (!(-lim->max_ts <= ts && ts <= lim->max_ts && 0.0 <= dur && dur <= lim->max_dur)) Py_RETURN_NONE;
    if (ps.pid.type != J_INT || ps.tid.type != J_INT) Py_RETURN_NONE;

    PyObject *out = PyTuple_New(6), *item;
    if (out == NULL) return NULL;
    Py_INCREF(cat);
    PyTuple_SET_ITEM(out, 0, cat);
    if ((item = PyFloat_FromDouble(ts)) == NULL) goto fail;
    PyTuple_SET_ITEM(out, 1, item);
    if ((item = PyFloat_FromDouble(dur)) == NULL) goto fail;
    PyTuple_SET_ITEM(out, 2, item);
    if (ps.name.type == J_NONE) {
        item = EMPTY;
        Py_INCREF(item);
    } else if ((item = name_str(ps.name.s, ps.name.e - ps.name.s)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(out, 3, item);
    item = Py_None;
    if (ps.args.type == J_OBJ && ps.corr.type == J_INT) {
        int neg = *ps.corr.s == '-';
        long long n = small_int((span){ps.corr.s + neg, ps.corr.e});
        /* a negative id is no id (ops.py); -0 is orjson's int 0 */
        if ((!neg || n == 0) && (item = PyLong_FromLongLong(n)) == NULL) goto fail;
    }
    if (item == Py_None) Py_INCREF(item);
    PyTuple_SET_ITEM(out, 4, item);
    if (ps.args.type == J_OBJ) {
        if ((item = PyBytes_FromStringAndSize(ps.args.s, ps.args.e - ps.args.s)) == NULL) goto fail;
    } else {
        item = Py_None;
        Py_INCREF(item);
    }
    PyTuple_SET_ITEM(out, 5, item);
    return out;
fail:
    Py_DECREF(out); /* a tuple's empty slots are NULL: safe to free half-built */
    return NULL;
}

/* ---- the loop over one buffer ---- */

/* the next `}\s*,\s*{` at or after p: its start in *sep, the position after its '{' returned */
static const char *next_sep(const char *p, const char *e, const char **sep) {
    while ((p = memchr(p, '}', (size_t)(e - p))) != NULL) {
        const char *q = skip_re_space(p + 1, e);
        if (q < e && *q == ',') {
            q = skip_re_space(q + 1, e);
            if (q < e && *q == '{') {
                *sep = p;
                return q + 1;
            }
        }
        p++;
    }
    return NULL;
}

enum { H_DONE, H_FALLBACK, H_ERROR };

static int set_launch(PyObject *launches, long long corr, double ts, long long tid) {
    PyObject *key = PyLong_FromLongLong(corr);
    PyObject *value = Py_BuildValue("(dL)", ts, tid);
    int rc = (key == NULL || value == NULL) ? -1 : PyDict_SetItem(launches, key, value);
    Py_XDECREF(key);
    Py_XDECREF(value);
    return rc;
}

/* one selected piece, as the body of reader.TraceReader._parse's loop */
static int handle(const char *p, const char *e, PyObject *items, PyObject *raw, PyObject *launches,
                  const limits *lim) {
    Py_ssize_t n = e - p;
    if (FIND_WITHIN(p, n, "_runtime\"", 0, 96) || FIND_WITHIN(p, n, "_driver\"", 0, 96)) {
        span tid, ts, corr;
        if (launch_match(p, e, &tid, &ts, &corr)) {
            long long t = small_int(tid), c = small_int(corr);
            double f;
            if (t < 0 || c < 0 || !py_float(ts, &f)) return H_FALLBACK; /* Python raises */
            if (!(-lim->max_ts <= f && f <= lim->max_ts)) return H_FALLBACK; /* Python drops it */
            return set_launch(launches, c, f, t) < 0 ? H_ERROR : H_DONE;
        }
    } else if (FIND_WITHIN(p, n, "\"user_annotation\"", 5, 96)) {
        if (FIND(p, e, "ProfilerStep#", 12) == NULL && !comm_mark(p, e)) return H_DONE;
    }
    PyObject *fields = gpu_fields(p, e, lim);
    if (fields == NULL) return H_ERROR;
    if (fields == Py_None) {
        /* Python parses this one: (position in items, the piece) */
        PyObject *entry = Py_BuildValue("(ny#)", PyList_GET_SIZE(items), p, n);
        int rc = entry == NULL ? -1 : PyList_Append(raw, entry);
        Py_XDECREF(entry);
        if (rc == 0) rc = PyList_Append(items, Py_None);
        Py_DECREF(fields);
        return rc < 0 ? H_ERROR : H_DONE;
    }
    int rc = PyList_Append(items, fields);
    Py_DECREF(fields);
    return rc < 0 ? H_ERROR : H_DONE;
}

PyDoc_STRVAR(scan_doc,
"scan(buf, hold, launches, max_ts, max_dur, max_string) -> (consumed, pieces, items, raw) or None\n\n"
"The events of buf (the traceEvents text after the opening '{'), all but the last `hold`\n"
"pieces. Launch records go into `launches` (correlation -> (time, thread)); items holds, in\n"
"reader order, a (cat, ts, dur, name, corr, args bytes | None) tuple per GPU event parsed here\n"
"and None where raw has (index, piece) for Python to parse (and, if drops.check refuses it,\n"
"drop). None: run the Python loop.");

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t hold;
    PyObject *launches;
    limits lim;
    if (!PyArg_ParseTuple(args, "y*nO!ddn", &view, &hold, &PyDict_Type, &launches, &lim.max_ts,
                          &lim.max_dur, &lim.max_string))
        return NULL;
    const char *b = view.buf, *e = b + view.len;
    PyObject *result = NULL, *items = NULL, *raw = NULL;
    Py_ssize_t cap = 4096, k = 0, nsteps = 0;
    span *pieces = PyMem_Malloc((size_t)cap * sizeof(span));
    Py_ssize_t *steps = NULL;
    if (pieces == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *start = b, *sep, *next;
    while ((next = next_sep(start, e, &sep)) != NULL) {
        if (k == cap) {
            cap *= 2;
            span *grown = PyMem_Realloc(pieces, (size_t)cap * sizeof(span));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            pieces = grown;
        }
        pieces[k].s = start;
        pieces[k].e = sep;
        k++;
        start = next;
    }
    Py_ssize_t limit = k - (hold < 0 ? 0 : hold);
    if (limit < 0) limit = 0;
    Py_ssize_t consumed = limit == 0 ? 0 : (limit < k ? pieces[limit].s : start) - b;
    items = PyList_New(0);
    raw = PyList_New(0);
    steps = PyMem_Malloc((size_t)(limit + 1) * sizeof(Py_ssize_t));
    if (items == NULL || raw == NULL || steps == NULL) {
        if (steps == NULL) PyErr_NoMemory();
        goto done;
    }
    int rc = H_DONE;
    /* like reader.py, look for ProfilerStep pieces only where the buffer has one */
    int any_step = FIND(b, e, "ProfilerStep#", 12) != NULL;
    for (Py_ssize_t i = 0; i < limit && rc == H_DONE; i++) {
        const char *ps = pieces[i].s, *pe = pieces[i].e;
        if (wanted(ps, pe)) rc = handle(ps, pe, items, raw, launches, &lim);
        else if (any_step && FIND(ps, pe, "ProfilerStep#", 12) != NULL) steps[nsteps++] = i;
    }
    /* ProfilerStep written as a cpu_op: reader.py appends these after the wanted ones */
    for (Py_ssize_t j = 0; j < nsteps && rc == H_DONE; j++)
        rc = handle(pieces[steps[j]].s, pieces[steps[j]].e, items, raw, launches, &lim);
    if (rc == H_ERROR) goto done;
    if (rc == H_FALLBACK) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    result = Py_BuildValue("(nnOO)", consumed, limit, items, raw);
done:
    PyMem_Free(pieces);
    PyMem_Free(steps);
    Py_XDECREF(items);
    Py_XDECREF(raw);
    PyBuffer_Release(&view);
    return result;
}


/* ---- the GPU events of one batch into the op builder (ops.OpBuilder.batch, in C) ---- */

PyDoc_STRVAR(take_doc,
"take(items, gpu, names, klass, raw_comm, gpu_event, classify, loads, Op, gpu_cats, consts)\n"
"-> (other events, events with bad times)\n\n"
"ops.OpBuilder.batch's loop: scanner tuples become Ops in `gpu` (names / klass / raw_comm\n"
"updated as there), dicts of a GPU category go to gpu_event(ev, cat), the rest is returned.\n"
"consts: (MAX_TS, MAX_DUR, COMPUTE, MEMORY, COMM, nan).");

typedef struct {
    PyObject *gpu, *names, *klass, *raw_comm, *classify, *loads, *compute, *memory, *comm, *nan;
    PyObject *one, *minus_one;
    PyTypeObject *op_type;
    double max_ts, max_dur;
    Py_ssize_t bad;
} taker;

/* the 9 fields into a new tuple: new references, except the end (items[1]), whose reference
 * moves into the tuple */
static void fill_op(PyObject *tuple, PyObject **items) {
    for (int f = 0; f < 9; f++) {
        if (f != 1) Py_INCREF(items[f]);
        PyTuple_SET_ITEM(tuple, f, items[f]);
    }
}

/* Op(ts, end, k, "", corr, "", -1, False, nan), built as tuple.__new__ builds it */
static PyObject *new_op(taker *t, PyObject *tsf, double end, PyObject *k, PyObject *corr) {
    PyObject *endf = PyFloat_FromDouble(end);
    if (endf == NULL) return NULL;
    PyObject *items[9] = {tsf, endf, k, EMPTY, corr, EMPTY, t->minus_one, Py_False, t->nan};
#if PY_VERSION_HEX < 0x030E0000
    /* what tuple_subtype_new does without the tuple it copies from: allocate the Op (a tuple
     * subclass without a dict: GC-tracked, items zeroed) and put the fields in */
    PyObject *op = t->op_type->tp_alloc(t->op_type, 9);
    if (op == NULL) {
        Py_DECREF(endf);
        return NULL;
    }
    fill_op(op, items);
    return op;
#else /* 3.14+ tuples cache their hash: tuple.__new__ sets the object up */
    PyObject *fields = PyTuple_New(9);
    if (fields == NULL) {
        Py_DECREF(endf);
        return NULL;
    }
    fill_op(fields, items);
    PyObject *call = PyTuple_Pack(1, fields);
    Py_DECREF(fields);
    if (call == NULL) return NULL;
    PyObject *op = PyTuple_Type.tp_new(t->op_type, call, NULL);
    Py_DECREF(call);
    return op;
#endif
}

/* one scanner tuple (held by the caller) into an Op, as OpBuilder.batch's loop body */
static int take_kernel(taker *t, PyObject *ev) {
    PyObject *cat = PyTuple_GET_ITEM(ev, 0), *tsf = PyTuple_GET_ITEM(ev, 1);
    PyObject *name = PyTuple_GET_ITEM(ev, 3), *corr = PyTuple_GET_ITEM(ev, 4);
    PyObject *raw_args = PyTuple_GET_ITEM(ev, 5);
    double ts = PyFloat_AsDouble(tsf), dur = PyFloat_AsDouble(PyTuple_GET_ITEM(ev, 2));
    if (PyErr_Occurred()) return -1;
    if (!(-t->max_ts <= ts && ts <= t->max_ts && 0.0 <= dur && dur <= t->max_dur)) {
        t->bad++; /* NaN fails both too */
        return 0;
    }
    double end = ts + dur;
    int is_kernel = cat == CAT_KERNEL ||
                    (PyUnicode_Check(cat) && PyUnicode_CompareWithASCIIString(cat, "kernel") == 0);
    PyObject *k; /* a strong reference: callbacks below run Python code */
    if (is_kernel) {
        k = PyDict_GetItemWithError(t->klass, name);
        if (k == NULL) {
            if (PyErr_Occurred()) return -1;
            k = PyObject_CallFunctionObjArgs(t->classify, name, cat, NULL);
            if (k == NULL || PyDict_SetItem(t->klass, name, k) < 0) {
                Py_XDECREF(k);
                return -1;
            }
        } else {
            Py_INCREF(k);
        }
    } else {
        k = t->memory;
        Py_INCREF(k);
    }
    int rc = -1;
    int is_compute = PyObject_RichCompareBool(k, t->compute, Py_EQ);
    if (is_compute < 0) goto done;
    if (is_compute) {
        PyObject *acc = PyDict_GetItemWithError(t->names, name);
        if (acc == NULL) {
            if (PyErr_Occurred()) goto done;
            PyObject *fresh = Py_BuildValue("[dd]", 1.0, end - ts);
            int set = fresh == NULL ? -1 : PyDict_SetItem(t->names, name, fresh);
            Py_XDECREF(fresh);
            if (set < 0) goto done;
        } else if (!PyList_CheckExact(acc) || PyList_GET_SIZE(acc) != 2) {
            PyErr_SetString(PyExc_TypeError, "names values must be [count, total] lists");
            goto done;
        } else {
            /* acc[0] += 1.0; acc[1] += end - ts, as Python adds them (no callback runs) */
            PyObject *len = PyFloat_FromDouble(end - ts);
            PyObject *a0 = len == NULL ? NULL : PyNumber_Add(PyList_GET_ITEM(acc, 0), t->one);
            PyObject *a1 = a0 == NULL ? NULL : PyNumber_Add(PyList_GET_ITEM(acc, 1), len);
            Py_XDECREF(len);
            if (a1 == NULL) {
                Py_XDECREF(a0);
                goto done;
            }
            PyList_SetItem(acc, 0, a0); /* steals */
            PyList_SetItem(acc, 1, a1);
        }
    } else {
        int is_comm = PyObject_RichCompareBool(k, t->comm, Py_EQ);
        if (is_comm < 0) goto done;
        if (is_comm) {
            PyObject *parsed = raw_args == Py_None ? PyDict_New()
                                                   : PyObject_CallOneArg(t->loads, raw_args);
            PyObject *entry = parsed == NULL ? NULL
                              : Py_BuildValue("(nOO)", PyList_GET_SIZE(t->gpu), name, parsed);
            Py_XDECREF(parsed);
            int added = entry == NULL ? -1 : PyList_Append(t->raw_comm, entry);
            Py_XDECREF(entry);
            if (added < 0) goto done;
        }
    }
    PyObject *op = new_op(t, tsf, end, k, corr);
    if (op == NULL) goto done;
    rc = PyList_Append(t->gpu, op);
    Py_DECREF(op);
done:
    Py_DECREF(k);
    return rc;
}

static PyObject *take(PyObject *self, PyObject *args) {
    PyObject *items, *gpu_event, *gpu_cats;
    taker t = {0};
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!OOOO!O!(ddOOOO)", &PyList_Type, &items, &PyList_Type,
                          &t.gpu, &PyDict_Type, &t.names, &PyDict_Type, &t.klass, &PyList_Type,
                          &t.raw_comm, &gpu_event, &t.classify, &t.loads, &PyType_Type,
                          &t.op_type, &PyTuple_Type, &gpu_cats, &t.max_ts, &t.max_dur, &t.compute,
                          &t.memory, &t.comm, &t.nan))
        return NULL;
    if (!PyType_IsSubtype(t.op_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "Op must be a tuple type");
        return NULL;
    }
    PyObject *rest = PyList_New(0);
    t.one = PyFloat_FromDouble(1.0);
    t.minus_one = PyLong_FromLong(-1);
    if (rest == NULL || t.one == NULL || t.minus_one == NULL) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *ev = PyList_GET_ITEM(items, i);
        Py_INCREF(ev); /* held: the callbacks run Python code */
        int rc = 0;
        if (PyTuple_CheckExact(ev) && PyTuple_GET_SIZE(ev) == 6) {
            rc = take_kernel(&t, ev);
        } else {
            /* a parsed dict: cat = ev.get("cat"); a GPU category goes to gpu_event */
            PyObject *cat = PyDict_Check(ev) ? PyDict_GetItemWithError(ev, CAT_KEY) : NULL;
            int gpu_cat = cat == NULL ? (PyErr_Occurred() ? -1 : 0)
                                      : PySequence_Contains(gpu_cats, cat);
            if (gpu_cat < 0) {
                rc = -1;
            } else if (gpu_cat) {
                PyObject *r = PyObject_CallFunctionObjArgs(gpu_event, ev, cat, NULL);
                rc = r == NULL ? -1 : 0;
                Py_XDECREF(r);
            } else {
                rc = PyList_Append(rest, ev);
            }
        }
        Py_DECREF(ev);
        if (rc < 0) goto fail;
    }
    Py_DECREF(t.one);
    Py_DECREF(t.minus_one);
    return Py_BuildValue("(Nn)", rest, t.bad);
fail:
    Py_XDECREF(rest);
    Py_XDECREF(t.one);
    Py_XDECREF(t.minus_one);
    return NULL;
}

/* ---- interval union (intervals.union, in C) ---- */

typedef struct {
    double a, b;
    Py_ssize_t i;
    PyObject *lo, *hi; /* held by collect(), released after the merge */
} run_item;

/* the order of Python's sorted() on (start, end) pairs: by start, then end, then position
 * (a stable sort): the same runs and the same float objects (-0.0 or 0.0) open them */
static int by_start(const void *x, const void *y) {
    const run_item *p = x, *q = y;
    if (p->a != q->a) return p->a < q->a ? -1 : 1;
    if (p->b != q->b) return p->b < q->b ? -1 : 1;
    return (p->i > q->i) - (p->i < q->i);
}

/* clip bounds for merge(): runs outside (lo, hi) dropped, the rest cut to [lo, hi] */
typedef struct {
    PyObject *lo, *hi; /* floats, or NULL: no clipping */
} bounds;

static PyObject *merge(run_item *items, Py_ssize_t n, double gap, bounds clip);

PyDoc_STRVAR(union_any_doc,
"union_any(pairs: list, gap: float, heads: bool = False) -> list[list[float]] or None\n\n"
"intervals.union: the pairs sorted by start here (the order among equal starts cannot change\n"
"the merged runs), then merged as union_sorted does; None when not all pairs of floats or NaN.\n"
"heads: the items are tuples (Ops) whose first two fields are the pair (intervals.union_heads).\n"
"lo, hi (floats): the merged runs clipped as intervals.clip does (clipped_union_heads).");

static void release(run_item *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(items[i].lo);
        Py_DECREF(items[i].hi);
    }
}

/* the pairs' floats, held (merging allocates, and a collection could run any code); 0 when not
 * all pairs of one kind (sorted() refuses to compare a list with a tuple) holding floats, or a
 * NaN (no order): the Python code decides */
static int collect(PyObject *pairs, run_item *items, int heads) {
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    int tuples = n > 0 && PyTuple_CheckExact(PyList_GET_ITEM(pairs, 0));
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(pairs, i), *a, *b;
        if (heads && PyTuple_Check(it) && PyTuple_GET_SIZE(it) >= 2) {
            a = PyTuple_GET_ITEM(it, 0);
            b = PyTuple_GET_ITEM(it, 1);
        } else if (heads) {
            release(items, i);
            return 0;
        } else if (tuples && PyTuple_CheckExact(it) && PyTuple_GET_SIZE(it) == 2) {
            a = PyTuple_GET_ITEM(it, 0);
            b = PyTuple_GET_ITEM(it, 1);
        } else if (!tuples && PyList_CheckExact(it) && PyList_GET_SIZE(it) == 2) {
            a = PyList_GET_ITEM(it, 0);
            b = PyList_GET_ITEM(it, 1);
        } else {
            release(items, i);
            return 0;
        }
        if (!PyFloat_CheckExact(a) || !PyFloat_CheckExact(b) ||
            PyFloat_AS_DOUBLE(a) != PyFloat_AS_DOUBLE(a) || PyFloat_AS_DOUBLE(b) != PyFloat_AS_DOUBLE(b)) {
            release(items, i);
            return 0;
        }
        items[i].a = PyFloat_AS_DOUBLE(a);
        items[i].b = PyFloat_AS_DOUBLE(b);
        items[i].i = i;
        Py_INCREF(a);
        Py_INCREF(b);
        items[i].lo = a;
        items[i].hi = b;
    }
    return 1;
}

static PyObject *union_any(PyObject *self, PyObject *args) {
    PyObject *pairs;
    double gap;
    int heads = 0;
    bounds clip = {NULL, NULL};
    if (!PyArg_ParseTuple(args, "O!d|pO!O!", &PyList_Type, &pairs, &gap, &heads, &PyFloat_Type,
                          &clip.lo, &PyFloat_Type, &clip.hi))
        return NULL;
    if ((clip.lo != NULL && !PyFloat_CheckExact(clip.lo)) || (clip.hi != NULL && !PyFloat_CheckExact(clip.hi)))
        Py_RETURN_NONE; /* a float subclass: Python's max / min decide */
    if (clip.lo != NULL && clip.hi == NULL) {
        PyErr_SetString(PyExc_TypeError, "union_any: clip needs both lo and hi");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    run_item *items = PyMem_Malloc((size_t)(n + 1) * sizeof(run_item));
    if (items == NULL) return PyErr_NoMemory();
    if (!collect(pairs, items, heads)) {
        PyMem_Free(items);
        Py_RETURN_NONE;
    }
    qsort(items, (size_t)n, sizeof(run_item), by_start);
    PyObject *out = merge(items, n, gap, clip);
    release(items, n);
    PyMem_Free(items);
    return out;
}

/* intervals.union_sorted's loop over items sorted by start (the same float objects in the runs),
 * then, with clip bounds, intervals.clip: a run is kept when b > lo and a < hi, as
 * [max(a, lo), min(b, hi)] with Python's tie rules (the first argument unless the second is
 * strictly beyond it: -0.0 and 0.0 stay what they were) */
/* out.append([a, b]); -1 on error */
static int append_run(PyObject *out, PyObject *a, PyObject *b) {
    PyObject *run = PyList_New(2);
    if (run == NULL) return -1;
    Py_INCREF(a);
    Py_INCREF(b);
    PyList_SET_ITEM(run, 0, a);
    PyList_SET_ITEM(run, 1, b);
    int rc = PyList_Append(out, run);
    Py_DECREF(run);
    return rc;
}

static PyObject *merge(run_item *items, Py_ssize_t n, double gap, bounds clip) {
    PyObject *out = PyList_New(0);
    if (out == NULL || n == 0) return out;
    PyObject *lo = items[0].lo, *hi = items[0].hi;
    for (Py_ssize_t i = 1; i <= n; i++) {
        if (i < n && PyFloat_AS_DOUBLE(items[i].lo) <= PyFloat_AS_DOUBLE(hi) + gap) {
            if (PyFloat_AS_DOUBLE(items[i].hi) > PyFloat_AS_DOUBLE(hi)) hi = items[i].hi;
            continue;
        }
        PyObject *a = lo, *b = hi;
        int keep = 1;
        if (clip.lo != NULL) {
            double clo = PyFloat_AS_DOUBLE(clip.lo), chi = PyFloat_AS_DOUBLE(clip.hi);
            keep = PyFloat_AS_DOUBLE(hi) > clo && PyFloat_AS_DOUBLE(lo) < chi;
            if (clo > PyFloat_AS_DOUBLE(lo)) a = clip.lo;
            if (chi < PyFloat_AS_DOUBLE(hi)) b = clip.hi;
        }
        if (keep && append_run(out, a, b) < 0) {
            Py_DECREF(out);
            return NULL;
        }
        if (i < n) {
            lo = items[i].lo;
            hi = items[i].hi;
        }
    }
    return out;
}

/* ---- intersection length of two merged lists (intervals.overlap, in C) ---- */

PyDoc_STRVAR(overlap_doc,
"overlap(x, y) -> float or None\n\n"
"intervals.overlap: the linear merge walk over two merged lists of [start, end] float pairs,\n"
"the lengths added in the same order (the same float); None when an item is not such a pair.");

static int pair_at(PyObject *list, Py_ssize_t i, double *a, double *b) {
    PyObject *it = PyList_GET_ITEM(list, i);
    if (!PyList_CheckExact(it) || PyList_GET_SIZE(it) != 2) return 0;
    PyObject *x = PyList_GET_ITEM(it, 0), *y = PyList_GET_ITEM(it, 1);
    if (!PyFloat_CheckExact(x) || !PyFloat_CheckExact(y)) return 0;
    *a = PyFloat_AS_DOUBLE(x);
    *b = PyFloat_AS_DOUBLE(y);
    return 1;
}

static PyObject *overlap(PyObject *self, PyObject *args) {
    PyObject *x, *y;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &x, &PyList_Type, &y)) return NULL;
    Py_ssize_t i = 0, j = 0, nx = PyList_GET_SIZE(x), ny = PyList_GET_SIZE(y);
    /* every pair checked first: the Python walk stops early and never looks at the rest */
    for (Py_ssize_t k = 0; k < nx + ny; k++) {
        double a, b;
        if (!pair_at(k < nx ? x : y, k < nx ? k : k - nx, &a, &b)) Py_RETURN_NONE;
    }
    double total = 0.0;
    while (i < nx && j < ny) {
        double xa, xb, ya, yb;
        pair_at(x, i, &xa, &xb);
        pair_at(y, j, &ya, &yb);
        double lo = xa > ya ? xa : ya;
        double hi = xb < yb ? xb : yb;
        if (hi > lo) total += hi - lo;
        if (xb < yb) i++;
        else j++;
    }
    return PyFloat_FromDouble(total);
}

/* ---- gaps of the compute stream (bubble._gaps_py, in C) ---- */

PyDoc_STRVAR(gaps_doc,
"gaps(comp, w0, w1, launches) -> list[tuple] or None\n\n"
"bubble._gaps_py: (gap start, gap end, launch of the op ending it) of the sorted compute ops in\n"
"[w0, w1], the same objects; None when an op or a launch is not as the reader builds them.");

/* bubble.posted: op.posted unless NaN, else its launch's time, else -inf (a new reference);
 * NULL with no error set: not as the reader builds it (the Python loop decides) */
static PyObject *posted_time(PyObject *op, PyObject *launches) {
    PyObject *p = PyTuple_GET_ITEM(op, 8), *corr = PyTuple_GET_ITEM(op, 4);
    if (!PyFloat_CheckExact(p)) return NULL;
    if (!isnan(PyFloat_AS_DOUBLE(p))) {
        Py_INCREF(p);
        return p;
    }
    PyObject *launch = NULL;
    if (corr != Py_None) {
        if (!PyLong_CheckExact(corr)) return NULL;
        launch = PyDict_GetItemWithError(launches, corr); /* int keys: no Python code runs */
        if (launch == NULL && PyErr_Occurred()) return NULL;
    }
    if (launch == NULL) return PyFloat_FromDouble(-INFINITY);
    if (!PyTuple_CheckExact(launch) || PyTuple_GET_SIZE(launch) < 1) return NULL;
    PyObject *at = PyTuple_GET_ITEM(launch, 0);
    Py_INCREF(at);
    return at;
}

static PyObject *gaps(PyObject *self, PyObject *args) {
    PyObject *comp, *w0, *w1, *launches;
    if (!PyArg_ParseTuple(args, "O!OOO!", &PyList_Type, &comp, &w0, &w1, &PyDict_Type, &launches))
        return NULL;
    if (!PyFloat_CheckExact(w0) || !PyFloat_CheckExact(w1)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(comp);
    for (Py_ssize_t i = 0; i < n; i++) { /* every op checked before any is used */
        PyObject *op = PyList_GET_ITEM(comp, i);
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < 9 || !PyFloat_CheckExact(PyTuple_GET_ITEM(op, 0)) ||
            !PyFloat_CheckExact(PyTuple_GET_ITEM(op, 1)))
            Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    PyObject *run_end = w0; /* borrowed: w0 or an op's end, all held by the caller */
    double hi = PyFloat_AS_DOUBLE(w1);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *op = PyList_GET_ITEM(comp, i);
        PyObject *start = PyTuple_GET_ITEM(op, 0), *end = PyTuple_GET_ITEM(op, 1);
        double s = PyFloat_AS_DOUBLE(start), r = PyFloat_AS_DOUBLE(run_end);
        if (s > r + 0.5 && s <= hi) {
            PyObject *at = posted_time(op, launches);
            if (at == NULL) {
                Py_DECREF(out);
                if (PyErr_Occurred()) return NULL;
                Py_RETURN_NONE;
            }
            PyObject *gap = PyTuple_Pack(3, run_end, start, at);
            Py_DECREF(at);
            int rc = gap == NULL ? -1 : PyList_Append(out, gap);
            Py_XDECREF(gap);
            if (rc < 0) {
                Py_DECREF(out);
                return NULL;
            }
        }
        if (PyFloat_AS_DOUBLE(end) > r) run_end = end;
    }
    return out;
}

/* ---- ops to steps (steps.assign, in C) ---- */

PyDoc_STRVAR(assign_doc,
"assign(starts, ends, ops, launches) -> list[list[Op]] or None\n\n"
"steps.assign: each op to the step during which its launch (else its own start) falls; None\n"
"when a time is not a float or a launch not a tuple (the Python loop then runs).");

static PyObject *assign(PyObject *self, PyObject *args) {
    PyObject *starts, *ends, *ops, *launches;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyList_Type, &starts, &PyList_Type, &ends,
                          &PyList_Type, &ops, &PyDict_Type, &launches))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(starts);
    if (PyList_GET_SIZE(ends) != n) Py_RETURN_NONE;
    double *lo = PyMem_Malloc((size_t)(n + 1) * 2 * sizeof(double));
    if (lo == NULL) return PyErr_NoMemory();
    double *hi = lo + n + 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyList_GET_ITEM(starts, i), *b = PyList_GET_ITEM(ends, i);
        if (!PyFloat_CheckExact(a) || !PyFloat_CheckExact(b)) {
            PyMem_Free(lo);
            Py_RETURN_NONE;
        }
        lo[i] = PyFloat_AS_DOUBLE(a);
        hi[i] = PyFloat_AS_DOUBLE(b);
    }
    PyObject *buckets = PyList_New(n);
    if (buckets == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *bucket = PyList_New(0);
        if (bucket == NULL) goto fail;
        PyList_SET_ITEM(buckets, i, bucket);
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(ops); k++) {
        PyObject *op = PyList_GET_ITEM(ops, k);
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < 5) goto python;
        PyObject *corr = PyTuple_GET_ITEM(op, 4), *launch = NULL, *t;
        if (corr != Py_None) {
            launch = PyDict_GetItemWithError(launches, corr);
            if (launch == NULL && PyErr_Occurred()) goto fail;
        }
        if (launch != NULL) {
            /* `launch[0] if launch else op.start`: a launch record is a non-empty tuple */
            if (!PyTuple_CheckExact(launch) || PyTuple_GET_SIZE(launch) == 0) goto python;
            t = PyTuple_GET_ITEM(launch, 0);
        } else {
            t = PyTuple_GET_ITEM(op, 0);
        }
        if (!PyFloat_CheckExact(t)) goto python;
        double x = PyFloat_AS_DOUBLE(t);
        Py_ssize_t a = 0, b = n; /* bisect_right(starts, x) */
        while (a < b) {
            Py_ssize_t mid = (a + b) / 2;
            if (x < lo[mid]) b = mid;
            else a = mid + 1;
        }
        Py_ssize_t i = a - 1;
        if (i >= 0 && x <= hi[i] && PyList_Append(PyList_GET_ITEM(buckets, i), op) < 0) goto fail;
    }
    PyMem_Free(lo);
    return buckets;
python:
    PyMem_Free(lo);
    Py_XDECREF(buckets);
    Py_RETURN_NONE;
fail:
    PyMem_Free(lo);
    Py_XDECREF(buckets);
    return NULL;
}

static PyMethodDef methods[] = {
    {"assign", assign, METH_VARARGS, assign_doc},
    {"union_any", union_any, METH_VARARGS, union_any_doc},
    {"overlap", overlap, METH_VARARGS, overlap_doc},
    {"gaps", gaps, METH_VARARGS, gaps_doc},
    {"scan", scan, METH_VARARGS, scan_doc},
    {"take", take, METH_VARARGS, take_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Native loops of the trace reader and op builder (reader.py, ops.py hold the Python reference).",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    CAT_KERNEL = PyUnicode_InternFromString("kernel");
    CAT_MEMCPY = PyUnicode_InternFromString("gpu_memcpy");
    CAT_MEMSET = PyUnicode_InternFromString("gpu_memset");
    EMPTY = PyUnicode_InternFromString("");
    CAT_KEY = PyUnicode_InternFromString("cat");
    init_plain();
    if (CAT_KERNEL == NULL || CAT_MEMCPY == NULL || CAT_MEMSET == NULL || EMPTY == NULL ||
        CAT_KEY == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    /* fastpath.NATIVE_API: the scan() signature reader.py calls; a build from older source
     * (an editable checkout not rebuilt) has another and is left unused */
    if (m != NULL && PyModule_AddIntConstant(m, "API", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
