/* events._native: vLLM's chained block hashing in one call per prompt.
 *
 * The pure-Python path (events/hashing.py) pays four interpreter calls per block; for an
 * 8k-token prompt (512 blocks) that alone was ~0.35 ms of a routing decision. Here each
 * block's message is serialised into one buffer and digested with OpenSSL's SHA-256
 * (SHA-NI where the CPU has it), so the whole chain costs a few microseconds per block.
 *
 * Byte-exact with the Python serialisers, which stay the reference:
 *   sha256_cbor: canonical CBOR of [parent: bytes, [uint...], keys] (keys pre-encoded)
 *   sha256:      pickle protocol 5 of (parent, tuple(tokens), None), one frame
 * Anything outside what is encoded here (negative or >= 2**64 ids, non-int items, pickle
 * extra keys, a pickle frame of 64 KiB or more) returns None: the caller takes the Python
 * path. Token ids come from a list/tuple of exact ints or a C-contiguous integer buffer.
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

#define DIGEST 32
#define CBOR_UINT_MAX 9    /* bytes of the longest canonical CBOR uint (head + 8) */
#define PICKLE_UINT_MAX 11 /* LONG1 of an id >= 2**63: opcode, length, 9 bytes */
#define FRAME_TARGET 65536 /* the C pickler splits frames at opcode boundaries past this */

/* ---- token ids ------------------------------------------------------------------------ */

/* Fills out[0..count) from obj. Returns 0, 1 (a value this module does not encode: the
 * caller falls back), or -1 with an exception set. */
static int
load_tokens(PyObject *obj, Py_ssize_t count, uint64_t *out)
{
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        PyObject *fast = PySequence_Fast(obj, "tokens");
        if (fast == NULL)
            return -1;
        if (PySequence_Fast_GET_SIZE(fast) < count) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "fewer token ids than blocks need");
            return -1;
        }
        PyObject **items = PySequence_Fast_ITEMS(fast);
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *v = items[i];
            if (!PyLong_CheckExact(v)) { /* bool, numpy scalars: serialised differently */
                Py_DECREF(fast);
                return 1;
            }
            unsigned long long x = PyLong_AsUnsignedLongLong(v);
            if (x == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear(); /* negative or >= 2**64 */
                Py_DECREF(fast);
                return 1;
            }
            out[i] = x;
        }
        Py_DECREF(fast);
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *fmt = view.format ? view.format : "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<')
        fmt++;
#if PY_BIG_ENDIAN
    if (view.format && view.format[0] == '<' && view.itemsize > 1) {
        PyBuffer_Release(&view);
        return 1;
    }
#endif
    int rc = 0;
    Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
    if (fmt[0] == '\0' || fmt[1] != '\0' || n < count) {
        rc = fmt[0] == '\0' || fmt[1] != '\0' ? 1 : -1;
        if (rc < 0)
            PyErr_SetString(PyExc_ValueError, "fewer token ids than blocks need");
        PyBuffer_Release(&view);
        return rc;
    }
    const char *p = (const char *)view.buf;
    int is_signed = (fmt[0] == 'b' || fmt[0] == 'h' || fmt[0] == 'i' || fmt[0] == 'l' ||
                     fmt[0] == 'q' || fmt[0] == 'n');
    int is_unsigned = (fmt[0] == 'B' || fmt[0] == 'H' || fmt[0] == 'I' || fmt[0] == 'L' ||
                       fmt[0] == 'Q' || fmt[0] == 'N');
    if (!is_signed && !is_unsigned) {
        PyBuffer_Release(&view);
        return 1;
    }
    for (Py_ssize_t i = 0; i < count && rc == 0; i++) {
        const char *q = p + i * view.itemsize;
        int64_t s = 0;
        uint64_t u = 0;
        switch (view.itemsize) {
        case 1: { uint8_t t; memcpy(&t, q, 1); u = t; s = (int8_t)t; break; }
        case 2: { uint16_t t; memcpy(&t, q, 2); u = t; s = (int16_t)t; break; }
        case 4: { uint32_t t; memcpy(&t, q, 4); u = t; s = (int32_t)t; break; }
        case 8: { uint64_t t; memcpy(&t, q, 8); u = t; s = (int64_t)t; break; }
        default: rc = 1; continue;
        }
        if (is_signed) {
            if (s < 0)
                rc = 1;
            u = (uint64_t)s;
        }
        out[i] = u;
    }
    PyBuffer_Release(&view);
    return rc;
}

/* ---- serialisers ---------------------------------------------------------------------- */

/* Canonical (shortest) CBOR head of major type `major` with argument n. */
static size_t
cbor_head(unsigned char *p, unsigned major, uint64_t n)
{
    unsigned char mt = (unsigned char)(major << 5);
    if (n < 24) {
        p[0] = mt | (unsigned char)n;
        return 1;
    }
    int w = n < 0x100 ? 1 : n < 0x10000 ? 2 : n < 0x100000000ULL ? 4 : 8;
    p[0] = mt | (w == 1 ? 24 : w == 2 ? 25 : w == 4 ? 26 : 27);
    for (int i = 0; i < w; i++)
        p[1 + i] = (unsigned char)(n >> (8 * (w - 1 - i)));
    return 1 + (size_t)w;
}

/* Pickle of one non-negative int as the C pickler writes it (BININT1/2, BININT, LONG1). */
static size_t
pickle_uint(unsigned char *p, uint64_t x)
{
    if (x < 0x100) {
        p[0] = 'K';
        p[1] = (unsigned char)x;
        return 2;
    }
    if (x < 0x10000) {
        p[0] = 'M';
        p[1] = (unsigned char)x;
        p[2] = (unsigned char)(x >> 8);
        return 3;
    }
    if (x < 0x80000000ULL) {
        p[0] = 'J';
        for (int i = 0; i < 4; i++)
            p[1 + i] = (unsigned char)(x >> (8 * i));
        return 5;
    }
    int bits = 64;
    while (!(x >> (bits - 1)))
        bits--;
    int nbytes = (bits >> 3) + 1; /* two's complement, room for the sign bit */
    p[0] = 0x8a;
    p[1] = (unsigned char)nbytes;
    for (int i = 0; i < nbytes; i++)
        p[2 + i] = i < 8 ? (unsigned char)(x >> (8 * i)) : 0;
    return 2 + (size_t)nbytes;
}

/* OpenSSL 3's one-shot SHA256() fetches the algorithm on every call (EVP_Q_digest); the
 * low-level context does not, and still dispatches to SHA-NI / AVX2. */
static inline void
sha256(const unsigned char *data, size_t len, unsigned char *out)
{
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, data, len);
    SHA256_Final(out, &ctx);
}

/* ---- the chains ----------------------------------------------------------------------- */

typedef struct {
    Py_ssize_t block_size, num_blocks;
    const unsigned char *parent;
    Py_ssize_t parent_len;
    uint64_t *tokens;
    unsigned char *msg;
    PyObject *out;
} chain_t;

/* Common argument handling: tokens, sizes, parent; allocates the token and message
 * buffers. Returns 0, 1 (fall back: caller returns None) or -1 (error). */
static int
chain_begin(chain_t *c, PyObject *tokens, Py_ssize_t per_token, Py_ssize_t fixed)
{
    if (c->block_size <= 0 || c->num_blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    if (c->num_blocks > PY_SSIZE_T_MAX / c->block_size / 16) {
        PyErr_SetString(PyExc_OverflowError, "too many tokens");
        return -1;
    }
    Py_ssize_t count = c->block_size * c->num_blocks;
    c->tokens = PyMem_Malloc(sizeof(uint64_t) * (size_t)(count ? count : 1));
    c->msg = PyMem_Malloc((size_t)(fixed + per_token * c->block_size));
    c->out = PyBytes_FromStringAndSize(NULL, DIGEST * c->num_blocks);
    if (c->tokens == NULL || c->msg == NULL || c->out == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    return load_tokens(tokens, count, c->tokens);
}

static PyObject *
chain_end(chain_t *c, int rc)
{
    PyMem_Free(c->tokens);
    PyMem_Free(c->msg);
    if (rc != 0) {
        Py_CLEAR(c->out);
        if (rc > 0)
            Py_RETURN_NONE;
        return NULL;
    }
    return c->out;
}

PyDoc_STRVAR(sha256_cbor_doc,
"sha256_cbor_chain(tokens, block_size, num_blocks, parent, keys) -> bytes | None\n\n"
"The sha256_cbor digests of num_blocks full blocks, concatenated (32 bytes each).\n"
"keys: None, or a sequence giving per block the canonical CBOR of its extra keys\n"
"(bytes) or None. None when some token id is not a uint64 (use the Python path).");

static PyObject *
sha256_cbor_chain(PyObject *self, PyObject *args)
{
    PyObject *tokens, *keys;
    chain_t c = {0};
    if (!PyArg_ParseTuple(args, "Onny#O", &tokens, &c.block_size, &c.num_blocks,
                          &c.parent, &c.parent_len, &keys))
        return NULL;
    PyObject **key_items = NULL;
    PyObject *key_fast = NULL;
    Py_ssize_t max_key = 1;
    if (keys != Py_None) {
        key_fast = PySequence_Fast(keys, "keys must be a sequence");
        if (key_fast == NULL)
            return NULL;
        if (PySequence_Fast_GET_SIZE(key_fast) < c.num_blocks) {
            Py_DECREF(key_fast);
            PyErr_SetString(PyExc_ValueError, "fewer keys than blocks");
            return NULL;
        }
        key_items = PySequence_Fast_ITEMS(key_fast);
        for (Py_ssize_t i = 0; i < c.num_blocks; i++) {
            PyObject *k = key_items[i];
            if (k != Py_None && !PyBytes_Check(k)) {
                Py_DECREF(key_fast);
                PyErr_SetString(PyExc_TypeError, "keys must be bytes or None");
                return NULL;
            }
            if (k != Py_None && PyBytes_GET_SIZE(k) > max_key)
                max_key = PyBytes_GET_SIZE(k);
        }
    }
    Py_ssize_t parent_room = c.parent_len > DIGEST ? c.parent_len : DIGEST;
    int rc = chain_begin(&c, tokens, CBOR_UINT_MAX, 1 + 9 + parent_room + 9 + max_key);
    if (rc == 0) {
        unsigned char array_head[9];
        size_t ah = cbor_head(array_head, 4, (uint64_t)c.block_size);
        unsigned char *digests = (unsigned char *)PyBytes_AS_STRING(c.out);
        const unsigned char *parent = c.parent;
        Py_ssize_t parent_len = c.parent_len;
        const uint64_t *t = c.tokens;
        for (Py_ssize_t b = 0; b < c.num_blocks; b++) {
            unsigned char *p = c.msg;
            *p++ = 0x83;
            p += cbor_head(p, 2, (uint64_t)parent_len);
            memcpy(p, parent, (size_t)parent_len);
            p += parent_len;
            memcpy(p, array_head, ah);
            p += ah;
            for (Py_ssize_t i = 0; i < c.block_size; i++)
                p += cbor_head(p, 0, *t++);
            PyObject *k = key_items ? key_items[b] : Py_None;
            if (k == Py_None) {
                *p++ = 0xf6;
            } else {
                memcpy(p, PyBytes_AS_STRING(k), (size_t)PyBytes_GET_SIZE(k));
                p += PyBytes_GET_SIZE(k);
            }
            unsigned char *d = digests + DIGEST * b;
            sha256(c.msg, (size_t)(p - c.msg), d);
            parent = d;
            parent_len = DIGEST;
        }
    }
    Py_XDECREF(key_fast);
    return chain_end(&c, rc);
}

PyDoc_STRVAR(sha256_pickle_doc,
"sha256_pickle_chain(tokens, block_size, num_blocks, parent) -> bytes | None\n\n"
"The sha256 (pickle protocol 5) digests of num_blocks full blocks without extra keys,\n"
"concatenated. None when a token id is not a uint64 or a block's pickle would not fit\n"
"one frame (use the Python path).");

static PyObject *
sha256_pickle_chain(PyObject *self, PyObject *args)
{
    PyObject *tokens;
    chain_t c = {0};
    if (!PyArg_ParseTuple(args, "Onny#", &tokens, &c.block_size, &c.num_blocks, &c.parent,
                          &c.parent_len))
        return NULL;
    Py_ssize_t parent_room = c.parent_len > DIGEST ? c.parent_len : DIGEST;
    int rc = chain_begin(&c, tokens, PICKLE_UINT_MAX, 2 + 9 + 9 + parent_room + 16);
    if (rc == 0) {
        unsigned char *digests = (unsigned char *)PyBytes_AS_STRING(c.out);
        const unsigned char *parent = c.parent;
        Py_ssize_t parent_len = c.parent_len;
        const uint64_t *t = c.tokens;
        for (Py_ssize_t b = 0; b < c.num_blocks && rc == 0; b++) {
            unsigned char *p = c.msg;
            *p++ = 0x80; /* PROTO 5 */
            *p++ = 5;
            *p++ = 0x95; /* FRAME, its 8-byte length filled in below */
            unsigned char *frame = p + 8;
            p = frame;
            if (parent_len < 0x100) { /* SHORT_BINBYTES / BINBYTES, then MEMOIZE */
                *p++ = 'C';
                *p++ = (unsigned char)parent_len;
            } else {
                *p++ = 'B';
                for (int i = 0; i < 4; i++)
                    *p++ = (unsigned char)((uint64_t)parent_len >> (8 * i));
            }
            memcpy(p, parent, (size_t)parent_len);
            p += parent_len;
            *p++ = 0x94;
            if (c.block_size > 3)
                *p++ = '('; /* MARK */
            for (Py_ssize_t i = 0; i < c.block_size; i++)
                p += pickle_uint(p, *t++);
            *p++ = c.block_size == 1 ? 0x85 : c.block_size == 2 ? 0x86
                 : c.block_size == 3 ? 0x87 : 't';
            *p++ = 0x94;
            *p++ = 'N';  /* no extra keys */
            *p++ = 0x87; /* TUPLE3 */
            *p++ = 0x94;
            *p++ = '.';
            uint64_t frame_len = (uint64_t)(p - frame);
            if (frame_len >= FRAME_TARGET) {
                rc = 1;
                break;
            }
            for (int i = 0; i < 8; i++)
                frame[i - 8] = (unsigned char)(frame_len >> (8 * i));
            unsigned char *d = digests + DIGEST * b;
            sha256(c.msg, (size_t)(p - c.msg), d);
            parent = d;
            parent_len = DIGEST;
        }
    }
    return chain_end(&c, rc);
}

PyDoc_STRVAR(pack_u32_doc,
"pack_u32(ids) -> bytes | None\n\n"
"A list/tuple of exact ints as packed native uint32, or None when one is not an int\n"
"in [0, 2**32) (array('I', ids) does the same, several times slower).");

/* An exact int's value when it is in [0, 2**32): 1 and *out; 0 when it is not; -1 when
 * this fast path cannot tell (pack_u32 then asks PyLong_AsUnsignedLongLong). Token ids
 * are one or two 30-bit digits: reading them in place, without a call per id, halves
 * the packing of a 240k-token prompt. */
static inline int
small_u32(PyObject *v, uint32_t *out)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v))
        return -1;
    Py_ssize_t x = PyUnstable_Long_CompactValue((PyLongObject *)v);
    if (x < 0 || (unsigned long long)x > 0xFFFFFFFFULL)
        return 0;
    *out = (uint32_t)x;
    return 1;
#else
    Py_ssize_t size = Py_SIZE(v);
    const digit *d = ((PyLongObject *)v)->ob_digit;
    if (size == 0) {
        *out = 0;
        return 1;
    }
    if (size == 1) {
        *out = (uint32_t)d[0];
        return 1;
    }
    if (size == 2) {
        uint64_t x = (uint64_t)d[0] | ((uint64_t)d[1] << PyLong_SHIFT);
        if (x > 0xFFFFFFFFULL)
            return 0;
        *out = (uint32_t)x;
        return 1;
    }
    return size < 0 ? 0 : -1;
#endif
}

static PyObject *
pack_u32(PyObject *self, PyObject *obj)
{
    PyObject *fast = PySequence_Fast(obj, "ids must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items[i];
        unsigned long long x;
        int quick = PyLong_CheckExact(v) ? small_u32(v, &dst[i]) : 0;
        if (quick == 1)
            continue;
        if (quick == 0 || !PyLong_CheckExact(v) ||
            ((x = PyLong_AsUnsignedLongLong(v)) == (unsigned long long)-1 && PyErr_Occurred()) ||
            x > 0xFFFFFFFFULL) {
            PyErr_Clear();
            Py_DECREF(fast);
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        dst[i] = (uint32_t)x;
    }
    Py_DECREF(fast);
    return out;
}

PyDoc_STRVAR(longest_prefix_doc,
"longest_prefix(candidates, b, unit) -> (index, items): the candidate (a list of bytes)\n"
"sharing the most whole unit-byte items with b from the start, the last one on ties;\n"
"(-1, 0) when none shares one (events.hashing.longest_prefix is the reference).");

static Py_ssize_t
shared_bytes(const unsigned char *p, const unsigned char *q, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i + 8 <= n) { /* a word at a time, then the bytes of the first differing one */
        uint64_t x, y;
        memcpy(&x, p + i, 8);
        memcpy(&y, q + i, 8);
        if (x != y)
            break;
        i += 8;
    }
    while (i < n && p[i] == q[i])
        i++;
    return i;
}

static PyObject *
longest_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "longest_prefix(list of bytes, bytes, unit)");
        return NULL;
    }
    Py_ssize_t unit = PyLong_AsSsize_t(args[2]);
    if (unit == -1 && PyErr_Occurred())
        return NULL;
    if (unit <= 0) {
        PyErr_SetString(PyExc_ValueError, "unit must be positive");
        return NULL;
    }
    PyObject *cands = args[0];
    const unsigned char *q = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    Py_ssize_t qlen = PyBytes_GET_SIZE(args[1]), best = 0, at = -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cands); i++) {
        PyObject *a = PyList_GET_ITEM(cands, i);
        if (!PyBytes_Check(a)) {
            PyErr_SetString(PyExc_TypeError, "longest_prefix: candidates must be bytes");
            return NULL;
        }
        Py_ssize_t alen = PyBytes_GET_SIZE(a);
        Py_ssize_t items = shared_bytes((const unsigned char *)PyBytes_AS_STRING(a), q,
                                        alen < qlen ? alen : qlen) / unit;
        if (items > 0 && items >= best) {
            best = items;
            at = i;
        }
    }
    return Py_BuildValue("(nn)", at, best);
}

static PyMethodDef methods[] = {
    {"sha256_cbor_chain", sha256_cbor_chain, METH_VARARGS, sha256_cbor_doc},
    {"sha256_pickle_chain", sha256_pickle_chain, METH_VARARGS, sha256_pickle_doc},
    {"pack_u32", pack_u32, METH_O, pack_u32_doc},
    {"longest_prefix", (PyCFunction)(void (*)(void))longest_prefix, METH_FASTCALL, longest_prefix_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "events._native",
    "Chained vLLM block hashing in C (events/hashing.py is the reference).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
