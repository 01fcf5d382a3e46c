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
 *
 * Also the memory index's lookup transpose and its event application (column_masks;
 * index_store, index_remove, index_compact: for router.index.memory, whose Python paths
 * are the reference). They came here when this was the package's one optional extension
 * and know nothing of the router but its data layout (router._refcounts, added since,
 * holds only the speculative store's table).
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
        if (!PyLong_CheckExact(v) ||
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

PyDoc_STRVAR(common_prefix_doc,
"common_prefix(a, b) -> int: how many leading bytes two bytes-like objects share\n"
"(router.prompt_hashes finds where a prompt leaves the last one that began the same way).");

static PyObject *
common_prefix(PyObject *self, PyObject *args)
{
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*", &a, &b))
        return NULL;
    Py_ssize_t n = a.len < b.len ? a.len : b.len, i = 0;
    const unsigned char *p = a.buf, *q = b.buf;
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
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(i);
}

/* ---- the memory index's lookup -------------------------------------------------------- */

/* router.index.memory keeps per block hash a bitset of the columns (instance, slot) that
 * hold it. A lookup wants the transpose: per column, the mask of the request's positions
 * it holds. In Python that is a step per (run of one holder set, column) pair and one per
 * column, ~30 us over 32 instances; here the positions are ORed as 64-bit words. */

typedef struct {
    Py_ssize_t holder, start, len;
} run_t;

static inline void
set_range(uint64_t *w, Py_ssize_t start, Py_ssize_t len)
{
    Py_ssize_t last = start + len - 1;
    Py_ssize_t a = start >> 6, b = last >> 6;
    uint64_t lo = ~0ULL << (start & 63), hi = ~0ULL >> (63 - (last & 63));
    if (a == b) {
        w[a] |= lo & hi;
        return;
    }
    w[a] |= lo;
    for (Py_ssize_t i = a + 1; i < b; i++)
        w[i] = ~0ULL;
    w[b] |= hi;
}

static PyObject *
int_from_words(const uint64_t *w, Py_ssize_t words, unsigned char *scratch)
{
    for (Py_ssize_t i = 0; i < words; i++)
        for (int k = 0; k < 8; k++)
            scratch[8 * i + k] = (unsigned char)(w[i] >> (8 * k));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(
        scratch, (size_t)(8 * words),
        Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
#else
    return _PyLong_FromByteArray(scratch, (size_t)(8 * words), 1, 0);
#endif
}

PyDoc_STRVAR(column_masks_doc,
"column_masks(blocks, hashes, keep, members, columns, members_max, owner) -> dict | None\n\n"
"router.index.memory's lookup (its Python path is the reference): per position of\n"
"hashes its holder set blocks.get(hash) (a bitset of columns; absent: none), runs of\n"
"equal holder sets, each holder set's columns (members[holder & keep], else\n"
"columns(holder & keep), remembered in members, which is cleared first once it holds\n"
"members_max), and per column the mask of the positions whose holder set has it:\n"
"{owner[col][0]: {owner[col][1]: mask}} (owner[col] None: left out). None when hashes\n"
"holds something other than an exact int (use the Python path).");

static PyObject *
column_masks(PyObject *self, PyObject *args)
{
    PyObject *blocks, *hashes, *keep, *members, *columns, *owner;
    Py_ssize_t members_max;
    if (!PyArg_ParseTuple(args, "O!O!OO!OnO!", &PyDict_Type, &blocks, &PyList_Type, &hashes,
                          &keep, &PyDict_Type, &members, &columns, &members_max,
                          &PyList_Type, &owner))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(hashes, i)))
            Py_RETURN_NONE;
    Py_ssize_t words = (n + 63) / 64, ncols = PyList_GET_SIZE(owner);
    run_t *runs = PyMem_Malloc(sizeof(run_t) * (size_t)(n ? n : 1));
    PyObject *number = PyDict_New(); /* holder set -> its index in holders */
    PyObject *holders = PyList_New(0);
    PyObject *out = PyDict_New();
    PyObject **each = NULL;          /* per holder set: its columns (a tuple) */
    uint64_t *pos = NULL, *bufs = NULL;
    Py_ssize_t *order = NULL;        /* the columns in first-touch order */
    uint32_t *touched = NULL;        /* per column: 0, or its place in order + 1 */
    unsigned char *scratch = NULL;
    Py_ssize_t nruns = 0, nh = 0, ntouched = 0;
    if (runs == NULL || number == NULL || holders == NULL || out == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto error;
    }
    /* 1. Runs of equal holder sets (== as itertools.groupby; absent blocks: none). The
     * holder sets are borrowed from blocks: nothing here runs Python code that could
     * change it (int keys and values only). */
    PyObject *cur = NULL;
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        PyObject *v = NULL;
        if (i < n) {
            v = PyDict_GetItemWithError(blocks, PyList_GET_ITEM(hashes, i));
            if (v == NULL && PyErr_Occurred())
                goto error;
            if (v == cur)
                continue;
            if (v != NULL && cur != NULL) {
                int eq = PyObject_RichCompareBool(v, cur, Py_EQ);
                if (eq < 0)
                    goto error;
                if (eq)
                    continue;
            }
        }
        if (cur != NULL) {
            int truth = PyObject_IsTrue(cur);
            if (truth < 0)
                goto error;
            if (truth) {
                PyObject *num = PyDict_GetItemWithError(number, cur);
                Py_ssize_t h;
                if (num != NULL) {
                    h = PyLong_AsSsize_t(num);
                } else {
                    if (PyErr_Occurred())
                        goto error;
                    h = PyList_GET_SIZE(holders);
                    PyObject *hn = PyLong_FromSsize_t(h);
                    if (hn == NULL)
                        goto error;
                    int rc = PyDict_SetItem(number, cur, hn);
                    Py_DECREF(hn);
                    if (rc < 0 || PyList_Append(holders, cur) < 0)
                        goto error;
                }
                runs[nruns].holder = h;
                runs[nruns].start = start;
                runs[nruns].len = i - start;
                nruns++;
            }
        }
        cur = v;
        start = i;
    }
    nh = PyList_GET_SIZE(holders);
    if (nh == 0)
        goto done;
    /* 2. Per holder set its positions, and its columns (kept ones only). */
    pos = PyMem_Calloc((size_t)(nh * words), sizeof(uint64_t));
    each = PyMem_Calloc((size_t)nh, sizeof(PyObject *));
    touched = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof(uint32_t));
    order = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(ncols ? ncols : 1));
    if (pos == NULL || each == NULL || touched == NULL || order == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t r = 0; r < nruns; r++)
        set_range(pos + runs[r].holder * words, runs[r].start, runs[r].len);
    for (Py_ssize_t h = 0; h < nh; h++) {
        PyObject *kept = PyNumber_And(PyList_GET_ITEM(holders, h), keep);
        if (kept == NULL)
            goto error;
        PyObject *cols = PyDict_GetItemWithError(members, kept);
        if (cols != NULL) {
            Py_INCREF(cols);
        } else if (!PyErr_Occurred()) {
            if (PyDict_GET_SIZE(members) >= members_max)
                PyDict_Clear(members);
            cols = PyObject_CallOneArg(columns, kept);
            if (cols != NULL && PyDict_SetItem(members, kept, cols) < 0)
                Py_CLEAR(cols);
        }
        Py_DECREF(kept);
        if (cols == NULL)
            goto error;
        each[h] = cols;
        if (!PyTuple_Check(cols)) {
            PyErr_SetString(PyExc_TypeError, "columns() must return a tuple");
            goto error;
        }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(cols); k++) {
            Py_ssize_t c = PyLong_AsSsize_t(PyTuple_GET_ITEM(cols, k));
            if (c == -1 && PyErr_Occurred())
                goto error;
            if (c < 0 || c >= ncols) {
                PyErr_SetString(PyExc_IndexError, "column without an owner entry");
                goto error;
            }
            if (!touched[c]) {
                order[ntouched] = c;
                touched[c] = (uint32_t)++ntouched;
            }
        }
    }
    /* 3. Per column, the OR of its holder sets' positions; then the owners' dicts. */
    bufs = PyMem_Calloc((size_t)((ntouched ? ntouched : 1) * words), sizeof(uint64_t));
    scratch = PyMem_Malloc((size_t)(8 * words));
    if (bufs == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t h = 0; h < nh; h++) {
        const uint64_t *src = pos + h * words;
        PyObject *cols = each[h];
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(cols); k++) {
            Py_ssize_t c = PyLong_AsSsize_t(PyTuple_GET_ITEM(cols, k));
            uint64_t *dst = bufs + (touched[c] - 1) * words;
            for (Py_ssize_t i = 0; i < words; i++)
                dst[i] |= src[i];
        }
    }
    for (Py_ssize_t k = 0; k < ntouched; k++) {
        PyObject *who = PyList_GET_ITEM(owner, order[k]);
        if (who == Py_None)
            continue;
        if (!PyTuple_Check(who) || PyTuple_GET_SIZE(who) != 2) {
            PyErr_SetString(PyExc_TypeError, "owner entries must be (instance, slot)");
            goto error;
        }
        PyObject *mask = int_from_words(bufs + k * words, words, scratch);
        if (mask == NULL)
            goto error;
        PyObject *name = PyTuple_GET_ITEM(who, 0);
        PyObject *res = PyDict_GetItemWithError(out, name);
        int rc = 0;
        if (res == NULL) {
            if (PyErr_Occurred() || (res = PyDict_New()) == NULL) {
                Py_DECREF(mask);
                goto error;
            }
            rc = PyDict_SetItem(out, name, res);
            Py_DECREF(res); /* out holds it */
        }
        if (rc == 0)
            rc = PyDict_SetItem(res, PyTuple_GET_ITEM(who, 1), mask);
        Py_DECREF(mask);
        if (rc < 0)
            goto error;
    }
done:
    if (each != NULL)
        for (Py_ssize_t h = 0; h < nh; h++)
            Py_XDECREF(each[h]);
    PyMem_Free(each);
    PyMem_Free(runs);
    PyMem_Free(pos);
    PyMem_Free(bufs);
    PyMem_Free(order);
    PyMem_Free(touched);
    PyMem_Free(scratch);
    Py_XDECREF(number);
    Py_XDECREF(holders);
    return out;
error:
    Py_CLEAR(out);
    goto done;
}

/* ---- the memory index's event application ---------------------------------------------- */

/* router.index.memory applies each BlockStored / BlockRemoved block as a few dict steps:
 * blocks[hash] is a bitset of columns, interned through ints so blocks sharing a holder set
 * share one int; dups[(hash, col)] counts a column's repeats of a block. In Python that is
 * a loop of bytecodes per block, and under an engine's eviction churn it was a fifth of the
 * router's CPU; here the same dict operations run in one C loop (its Python path stays the
 * reference). Every hash must be an exact int in [0, 2**64): otherwise None and nothing is
 * changed (the caller converts and takes the Python path). */

static int
exact_u64_list(PyObject *hashes)
{
    if (!PyList_CheckExact(hashes))
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        if (!PyLong_CheckExact(h))
            return 0;
        (void)PyLong_AsUnsignedLongLong(h);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    }
    return 1;
}

/* 1 when the bitset v (NULL: none) has bit set, 0 when not, -1 on error. */
static int
has_bit(PyObject *v, PyObject *bit)
{
    if (v == NULL)
        return 0;
    PyObject *x = PyNumber_And(v, bit);
    if (x == NULL)
        return -1;
    int r = PyObject_IsTrue(x);
    Py_DECREF(x);
    return r;
}

/* The bitset blocks[h] in *v (borrowed; NULL: none) and whether it has bit: 1, 0, -1. */
static int
column_holds(PyObject *blocks, PyObject *h, PyObject *bit, PyObject **v)
{
    *v = PyDict_GetItemWithError(blocks, h);
    if (*v == NULL && PyErr_Occurred())
        return -1;
    return has_bit(*v, bit);
}

/* dups[(h, col)] += delta (+1, or -1 with the entry gone at 0): 1 when changed, 0 when
 * delta is -1 and there is no repeat to take back, -1 on error. */
static int
bump_repeat(PyObject *dups, PyObject *h, PyObject *colobj, long delta)
{
    PyObject *key = PyTuple_Pack(2, h, colobj);
    if (key == NULL)
        return -1;
    PyObject *extra = PyDict_GetItemWithError(dups, key); /* borrowed */
    long k = extra == NULL ? 0 : PyLong_AsLong(extra);
    int r;
    if (PyErr_Occurred())
        r = -1;
    else if (k + delta < 0)
        r = 0;
    else if (k + delta == 0)
        r = PyDict_DelItem(dups, key) < 0 ? -1 : 1;
    else {
        PyObject *nk = PyLong_FromLong(k + delta);
        r = nk == NULL || PyDict_SetItem(dups, key, nk) < 0 ? -1 : 1;
        Py_XDECREF(nk);
    }
    Py_DECREF(key);
    return r;
}

/* col and 1 << col as ints (new references in *colobj and *bit); -1 with an exception. */
static int
column_bit(Py_ssize_t col, PyObject **colobj, PyObject **bit)
{
    PyObject *one = PyLong_FromLong(1);
    *colobj = PyLong_FromSsize_t(col);
    *bit = one != NULL && *colobj != NULL ? PyNumber_Lshift(one, *colobj) : NULL;
    Py_XDECREF(one);
    return *bit == NULL ? -1 : 0;
}

/* blocks[h] = ints.setdefault(v, v) for the bitset v (a new reference, consumed). */
static int
set_interned(PyObject *blocks, PyObject *ints, PyObject *h, PyObject *v)
{
    PyObject *canon = PyDict_SetDefault(ints, v, v); /* borrowed */
    int r = canon == NULL ? -1 : PyDict_SetItem(blocks, h, canon);
    Py_DECREF(v);
    return r;
}

/* index_store's and index_remove's arguments: 1, 0 (a hash that is not an exact u64 int:
 * the caller returns None) or -1 with an exception set. */
static int
apply_args(PyObject *args, PyObject **blocks, PyObject **ints, PyObject **dups,
           Py_ssize_t *col, PyObject **hashes)
{
    if (!PyArg_ParseTuple(args, "O!O!O!nO", &PyDict_Type, blocks, &PyDict_Type, ints,
                          &PyDict_Type, dups, col, hashes))
        return -1;
    return exact_u64_list(*hashes);
}

PyDoc_STRVAR(index_store_doc,
"index_store(blocks, ints, dups, col, hashes) -> (stored, new: bytes) | None\n\n"
"router.index.memory's _store for column col: each hash's bitset gains 1 << col\n"
"(interned through ints), or dups[(hash, col)] counts a repeat. new: the newly held\n"
"hashes as native uint64, for the column's log. None: a hash is not an exact u64 int.");

static PyObject *
index_store(PyObject *self, PyObject *args)
{
    PyObject *blocks, *ints, *dups, *hashes;
    Py_ssize_t col;
    int ok = apply_args(args, &blocks, &ints, &dups, &col, &hashes);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n = PyList_GET_SIZE(hashes), fresh = 0;
    PyObject *colobj = NULL, *bit = NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * (n ? n : 1));
    if (out == NULL || column_bit(col, &colobj, &bit) < 0)
        goto error;
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i), *v;
        int held = column_holds(blocks, h, bit, &v);
        if (held < 0)
            goto error;
        if (held) { /* a repeat of a block the column holds */
            if (bump_repeat(dups, h, colobj, +1) < 0)
                goto error;
            continue;
        }
        PyObject *nv = v == NULL ? Py_NewRef(bit) : PyNumber_Or(v, bit);
        if (nv == NULL || set_interned(blocks, ints, h, nv) < 0)
            goto error;
        dst[fresh++] = PyLong_AsUnsignedLongLong(h);
    }
    if (_PyBytes_Resize(&out, 8 * fresh) < 0)
        goto error_out_gone;
    Py_DECREF(colobj);
    Py_DECREF(bit);
    return Py_BuildValue("(nN)", n, out);
error:
    Py_XDECREF(out);
error_out_gone:
    Py_XDECREF(colobj);
    Py_XDECREF(bit);
    return NULL;
}

PyDoc_STRVAR(index_remove_doc,
"index_remove(blocks, ints, dups, col, hashes) -> (done, released) | None\n\n"
"router.index.memory's _remove for column col: a hash the column holds takes back one\n"
"repeat from dups, else loses 1 << col (the block leaves blocks with its last column).\n"
"done: hashes the column held; released: those it no longer holds. None: as index_store.");

static PyObject *
index_remove(PyObject *self, PyObject *args)
{
    PyObject *blocks, *ints, *dups, *hashes;
    Py_ssize_t col;
    int ok = apply_args(args, &blocks, &ints, &dups, &col, &hashes);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n = PyList_GET_SIZE(hashes), done = 0, released = 0;
    PyObject *colobj = NULL, *bit = NULL;
    if (column_bit(col, &colobj, &bit) < 0)
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i), *v;
        int held = column_holds(blocks, h, bit, &v);
        if (held < 0)
            goto error;
        if (!held)
            continue;
        done++;
        if (PyDict_GET_SIZE(dups)) { /* a repeat to take back first (rare: none at all) */
            int r = bump_repeat(dups, h, colobj, -1);
            if (r < 0)
                goto error;
            if (r)
                continue;
        }
        PyObject *nv = PyNumber_Xor(v, bit);
        if (nv == NULL)
            goto error;
        int nonzero = PyObject_IsTrue(nv);
        if (nonzero < 0) {
            Py_DECREF(nv);
            goto error;
        }
        if (nonzero) {
            if (set_interned(blocks, ints, h, nv) < 0)
                goto error;
        } else {
            Py_DECREF(nv);
            if (PyDict_DelItem(blocks, h) < 0)
                goto error;
        }
        released++;
    }
    Py_DECREF(colobj);
    Py_DECREF(bit);
    return Py_BuildValue("(nn)", done, released);
error:
    Py_XDECREF(colobj);
    Py_XDECREF(bit);
    return NULL;
}

PyDoc_STRVAR(index_compact_doc,
"index_compact(blocks, col, log) -> bytes\n\n"
"router.index.memory's _compact: of a column's log (native uint64 hashes, bytes-like),\n"
"the hashes whose bitset in blocks still has 1 << col, each once, in first-seen order.");

static PyObject *
index_compact(PyObject *self, PyObject *args)
{
    PyObject *blocks;
    Py_ssize_t col;
    Py_buffer log;
    if (!PyArg_ParseTuple(args, "O!ny*", &PyDict_Type, &blocks, &col, &log))
        return NULL;
    Py_ssize_t n = log.len / 8, cap = 16, kept = 0;
    while (cap < 2 * n)
        cap <<= 1;
    uint64_t *seen = PyMem_Calloc((size_t)cap, sizeof(uint64_t));
    unsigned char *used = PyMem_Calloc((size_t)cap, 1);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * (n ? n : 1));
    PyObject *colobj = NULL, *bit = NULL;
    if (seen == NULL || used == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    if (out == NULL || column_bit(col, &colobj, &bit) < 0)
        goto error;
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h;
        memcpy(&h, (const char *)log.buf + 8 * i, 8);
        Py_ssize_t j = (Py_ssize_t)((h * 0x9E3779B97F4A7C15ULL) >> 1) & (cap - 1);
        while (used[j] && seen[j] != h)
            j = (j + 1) & (cap - 1);
        if (used[j])
            continue; /* logged again after a removal: kept once */
        used[j] = 1;
        seen[j] = h;
        PyObject *key = PyLong_FromUnsignedLongLong(h);
        if (key == NULL)
            goto error;
        PyObject *v = PyDict_GetItemWithError(blocks, key); /* borrowed */
        Py_DECREF(key);
        if (v == NULL && PyErr_Occurred())
            goto error;
        int held = has_bit(v, bit);
        if (held < 0)
            goto error;
        if (held)
            dst[kept++] = h;
    }
    if (_PyBytes_Resize(&out, 8 * kept) < 0)
        out = NULL;
    goto done;
error:
    Py_CLEAR(out);
done:
    PyMem_Free(seen);
    PyMem_Free(used);
    Py_XDECREF(colobj);
    Py_XDECREF(bit);
    PyBuffer_Release(&log);
    return out;
}

static PyMethodDef methods[] = {
    {"sha256_cbor_chain", sha256_cbor_chain, METH_VARARGS, sha256_cbor_doc},
    {"sha256_pickle_chain", sha256_pickle_chain, METH_VARARGS, sha256_pickle_doc},
    {"pack_u32", pack_u32, METH_O, pack_u32_doc},
    {"common_prefix", common_prefix, METH_VARARGS, common_prefix_doc},
    {"column_masks", column_masks, METH_VARARGS, column_masks_doc},
    {"index_store", index_store, METH_VARARGS, index_store_doc},
    {"index_remove", index_remove, METH_VARARGS, index_remove_doc},
    {"index_compact", index_compact, METH_VARARGS, index_compact_doc},
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
