/* router._refcounts: the speculative store's refcount table, uint64 block hash -> count.
 *
 * router.speculative keeps, per instance and class of KV cache groups, how many routed
 * requests hold each block hash. A request adds one to each of its blocks when it is
 * routed and takes it back when it is released: two passes over its blocks, on every
 * request, in a table of every block routed in the last seconds (~100k entries at 16
 * clients with no events arriving). In a dict each entry is ~80 bytes of boxed objects
 * spread over the heap and a release is a Python loop; here a slot is 16 bytes in one
 * array (open addressing, linear probing, backward-shift deletion: no tombstones) and
 * every pass is one C loop. router.speculative's PyRefCounts is the reference.
 *
 * A slot is empty when its count is 0, so every uint64 is a valid key. Keys are wire
 * hashes (SHA-256 digests' low 64 bits), mixed by a Fibonacci multiply all the same.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIN_CAP 16

typedef struct {
    uint64_t key;
    uint64_t count; /* 0: empty */
} slot_t;

typedef struct {
    PyObject_HEAD
    slot_t *slots;
    Py_ssize_t cap; /* a power of two */
    Py_ssize_t used;
    int shift; /* 64 - log2(cap) */
} RefCounts;

static inline Py_ssize_t
home(const RefCounts *t, uint64_t key)
{
    return (Py_ssize_t)((key * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

/* The slot holding key, or -1. */
static inline Py_ssize_t
find(const RefCounts *t, uint64_t key)
{
    Py_ssize_t mask = t->cap - 1, i = home(t, key);
    while (t->slots[i].count) {
        if (t->slots[i].key == key)
            return i;
        i = (i + 1) & mask;
    }
    return -1;
}

static int
resize(RefCounts *t, Py_ssize_t cap)
{
    slot_t *fresh = PyMem_Calloc((size_t)cap, sizeof(slot_t));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    slot_t *old = t->slots;
    Py_ssize_t old_cap = t->cap;
    int bits = 0;
    while (((Py_ssize_t)1 << bits) < cap)
        bits++;
    t->slots = fresh;
    t->cap = cap;
    t->shift = 64 - bits;
    for (Py_ssize_t j = 0; j < old_cap; j++) {
        if (old[j].count) {
            Py_ssize_t i = home(t, old[j].key);
            while (fresh[i].count)
                i = (i + 1) & (cap - 1);
            fresh[i] = old[j];
        }
    }
    PyMem_Free(old);
    return 0;
}

/* Backward-shift deletion: later members of the probe run move up into the hole. */
static void
erase(RefCounts *t, Py_ssize_t i)
{
    Py_ssize_t mask = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->slots[j].count)
            break;
        Py_ssize_t h = home(t, t->slots[j].key);
        /* j's entry may fill the hole at i unless its home lies cyclically in (i, j] */
        if (i <= j ? (i < h && h <= j) : (i < h || h <= j))
            continue;
        t->slots[i] = t->slots[j];
        i = j;
    }
    t->slots[i].count = 0;
    t->used--;
}

/* Keys into a fresh array (n of them): from a list/tuple of ints in [0, 2**64), or from a
 * buffer of native uint64 (array('Q'): a caller asking several tables about one prompt
 * converts its hashes once). */
static uint64_t *
load_keys(PyObject *seq, Py_ssize_t *n)
{
    if (!PyList_Check(seq) && !PyTuple_Check(seq) && PyObject_CheckBuffer(seq)) {
        Py_buffer view;
        if (PyObject_GetBuffer(seq, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            return NULL;
        const char *fmt = view.format ? view.format : "B";
        if (*fmt == '@' || *fmt == '=')
            fmt++;
        if (view.itemsize != 8 || fmt[1] != '\0' || (fmt[0] != 'Q' && fmt[0] != 'L')) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "a hash buffer must hold native uint64 ('Q')");
            return NULL;
        }
        *n = view.len / 8;
        uint64_t *keys = PyMem_Malloc(sizeof(uint64_t) * (size_t)(*n ? *n : 1));
        if (keys == NULL) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            return NULL;
        }
        memcpy(keys, view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
        return keys;
    }
    PyObject *fast = PySequence_Fast(seq, "block hashes must be a sequence");
    if (fast == NULL)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(fast);
    uint64_t *keys = PyMem_Malloc(sizeof(uint64_t) * (size_t)(*n ? *n : 1));
    if (keys == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *v = items[i];
        unsigned long long x = (unsigned long long)-1;
        if (PyLong_Check(v))
            x = PyLong_AsUnsignedLongLong(v);
        else
            PyErr_SetString(PyExc_TypeError, "a block hash must be an int");
        if (x == (unsigned long long)-1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_SetString(PyExc_OverflowError, "a block hash must be in [0, 2**64)");
            }
            PyMem_Free(keys);
            Py_DECREF(fast);
            return NULL;
        }
        keys[i] = x;
    }
    Py_DECREF(fast);
    return keys;
}

PyDoc_STRVAR(add_doc, "add(hashes): one more holder of each hash (a hash listed twice: two).");

static PyObject *
RefCounts_add(RefCounts *t, PyObject *seq)
{
    Py_ssize_t n;
    uint64_t *keys = load_keys(seq, &n);
    if (keys == NULL)
        return NULL;
    if ((t->used + n) * 2 > t->cap) {
        Py_ssize_t cap = t->cap;
        while ((t->used + n) * 2 > cap)
            cap <<= 1;
        if (resize(t, cap) < 0) {
            PyMem_Free(keys);
            return NULL;
        }
    }
    Py_ssize_t mask = t->cap - 1;
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t key = keys[k];
        Py_ssize_t i = home(t, key);
        while (t->slots[i].count && t->slots[i].key != key)
            i = (i + 1) & mask;
        if (!t->slots[i].count) {
            t->slots[i].key = key;
            t->used++;
        }
        t->slots[i].count++;
    }
    PyMem_Free(keys);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(remove_doc,
"remove(hashes): one holder fewer of each hash; a hash held by none leaves the table.\n"
"KeyError (after the hashes before it were taken) for a hash not in the table.");

static PyObject *
RefCounts_remove(RefCounts *t, PyObject *seq)
{
    Py_ssize_t n;
    uint64_t *keys = load_keys(seq, &n);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i = find(t, keys[k]);
        if (i < 0) {
            PyObject *h = PyLong_FromUnsignedLongLong(keys[k]);
            if (h != NULL) {
                PyErr_SetObject(PyExc_KeyError, h);
                Py_DECREF(h);
            }
            PyMem_Free(keys);
            return NULL;
        }
        if (--t->slots[i].count == 0)
            erase(t, i);
    }
    PyMem_Free(keys);
    /* Give memory back after a burst: below an eighth full, halve until at least an
     * eighth full (it grows again past half: no resizing back and forth). */
    if (t->cap > MIN_CAP && t->used * 8 < t->cap) {
        Py_ssize_t cap = t->cap;
        while (cap > MIN_CAP && t->used * 8 < cap)
            cap >>= 1;
        if (resize(t, cap) < 0)
            PyErr_Clear(); /* keeping the larger table is fine */
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(count_doc, "count(hash) -> int: how many holders hash has (0: none).");

/* The slot holding h, or -1: absent, or h is not an int in [0, 2**64) (held by none). */
static Py_ssize_t
find_obj(const RefCounts *t, PyObject *h)
{
    if (!PyLong_Check(h))
        return -1;
    unsigned long long x = PyLong_AsUnsignedLongLong(h);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return find(t, x);
}

static PyObject *
RefCounts_count(RefCounts *t, PyObject *h)
{
    Py_ssize_t i = find_obj(t, h);
    return PyLong_FromUnsignedLongLong(i < 0 ? 0 : t->slots[i].count);
}

PyDoc_STRVAR(prefix_doc,
"prefix(hashes) -> int: how many leading hashes are held, by bisection. Exact when what\n"
"is held is closed under prefixes of hashes (a union of hash chains: every member's\n"
"predecessors in hashes are held too), as the speculative store's whole classes are.");

static PyObject *
RefCounts_prefix(RefCounts *t, PyObject *seq)
{
    Py_ssize_t n;
    uint64_t *keys = load_keys(seq, &n);
    if (keys == NULL)
        return NULL;
    Py_ssize_t lo;
    if (n == 0 || find(t, keys[0]) < 0)
        lo = 0;
    else if (find(t, keys[n - 1]) >= 0)
        lo = n;
    else { /* keys[lo - 1] held, keys[hi - 1] not */
        lo = 1;
        Py_ssize_t hi = n;
        while (hi - lo > 1) {
            Py_ssize_t mid = (lo + hi) >> 1;
            if (find(t, keys[mid - 1]) >= 0)
                lo = mid;
            else
                hi = mid;
        }
    }
    PyMem_Free(keys);
    return PyLong_FromSsize_t(lo);
}

PyDoc_STRVAR(mask_doc, "mask(hashes) -> int: bit i set where hashes[i] is held.");

static PyObject *
RefCounts_mask(RefCounts *t, PyObject *seq)
{
    Py_ssize_t n;
    uint64_t *keys = load_keys(seq, &n);
    if (keys == NULL)
        return NULL;
    Py_ssize_t words = (n + 63) / 64;
    unsigned char *bytes = PyMem_Calloc((size_t)(words ? words : 1), 8);
    if (bytes == NULL) {
        PyMem_Free(keys);
        return PyErr_NoMemory();
    }
    if (t->used)
        for (Py_ssize_t k = 0; k < n; k++)
            if (find(t, keys[k]) >= 0)
                bytes[k >> 3] |= (unsigned char)(1u << (k & 7));
    PyMem_Free(keys);
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *out = PyLong_FromUnsignedNativeBytes(
        bytes, (size_t)(8 * words), Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
#else
    PyObject *out = _PyLong_FromByteArray(bytes, (size_t)(8 * words), 1, 0);
#endif
    PyMem_Free(bytes);
    return out;
}

static Py_ssize_t
RefCounts_len(RefCounts *t)
{
    return t->used;
}

static int
RefCounts_contains(RefCounts *t, PyObject *h)
{
    return find_obj(t, h) >= 0;
}

static PyObject *
RefCounts_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "RefCounts() takes no arguments");
        return NULL;
    }
    RefCounts *t = (RefCounts *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->slots = PyMem_Calloc(MIN_CAP, sizeof(slot_t));
    if (t->slots == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->cap = MIN_CAP;
    t->shift = 64 - 4;
    t->used = 0;
    return (PyObject *)t;
}

static void
RefCounts_dealloc(RefCounts *t)
{
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef RefCounts_methods[] = {
    {"add", (PyCFunction)RefCounts_add, METH_O, add_doc},
    {"remove", (PyCFunction)RefCounts_remove, METH_O, remove_doc},
    {"count", (PyCFunction)RefCounts_count, METH_O, count_doc},
    {"prefix", (PyCFunction)RefCounts_prefix, METH_O, prefix_doc},
    {"mask", (PyCFunction)RefCounts_mask, METH_O, mask_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods RefCounts_as_sequence = {
    .sq_length = (lenfunc)RefCounts_len,
    .sq_contains = (objobjproc)RefCounts_contains,
};

static PyTypeObject RefCountsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router._refcounts.RefCounts",
    .tp_doc = "uint64 block hash -> number of holders (router.speculative.PyRefCounts is the "
              "reference).",
    .tp_basicsize = sizeof(RefCounts),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = RefCounts_new,
    .tp_dealloc = (destructor)RefCounts_dealloc,
    .tp_methods = RefCounts_methods,
    .tp_as_sequence = &RefCounts_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._refcounts",
    "The speculative store's refcount table in C (router.speculative.PyRefCounts is the "
    "reference).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__refcounts(void)
{
    if (PyType_Ready(&RefCountsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RefCountsType);
    if (PyModule_AddObject(m, "RefCounts", (PyObject *)&RefCountsType) < 0) {
        Py_DECREF(&RefCountsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
