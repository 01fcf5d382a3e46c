/* router.index._memindex: the memory index's block table, its storage and the loops over it.
 *
 * BlockTable owns the memory index's per-block state: per wire hash the set of columns
 * holding it, and dups ((hash, column) -> repeats above one: vLLM does not deduplicate
 * physical blocks). router.index.memory (MemoryIndex) keeps the rest -- instances,
 * columns, per-column logs, cursors -- and reaches the table only through the API below,
 * which router.index.table.PyBlockTable implements in Python, the reference;
 * tests/router/test_index_table.py runs random event streams through both and compares
 * their whole state.
 *
 * Storage: an open-addressing table (linear probing, backward-shift deletion, no
 * tombstones) of 16-byte slots, the u64 wire hash inline and a u32 holder-set id. A
 * holder set is stored once (its bitset as a Python int, as words and as its columns)
 * and counts the blocks that hold it: it goes with its last block, so what the table
 * keeps is exactly what its blocks need. A store or removal moves a block from one set
 * to another through a small cache of such moves (most blocks of a batch make the same
 * move), so applying events costs a probe and a few counts per block, no Python object.
 *
 * Why: a 240k-token prompt is 15k lookups in a table of millions of blocks, scattered in
 * memory. With a Python dict each was several cache misses (index, entry, the key's int
 * object) and the lookup was the largest part of a decision, growing several-fold when
 * other processes evicted the caches; here each is one slot, prefetched ahead of the
 * walk. An entry also costs 16-32 bytes of table instead of ~90 (dict entry, index and
 * the key's int object).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t key;
    uint32_t set; /* 0: an empty slot */
    uint32_t _pad;
} slot_t;

typedef struct {
    PyObject *bits;  /* the bitset, a Python int; NULL: a free id */
    uint64_t *words; /* its bits */
    int32_t *cols;   /* its columns, ascending */
    Py_ssize_t nwords, ncols;
    Py_ssize_t refs; /* blocks holding exactly this set */
} hset_t;

/* A cached move: the block in set `from` gains (add) or loses column `col` -> set `to`. */
typedef struct {
    uint32_t from, to;
    int32_t col;
    int32_t add;
    uint64_t gen;
} move_t;

#define MOVES 4096
#define PREFETCH 16

typedef struct {
    PyObject_HEAD
    slot_t *slots;
    size_t cap, count; /* cap: a power of two */
    int shift;         /* 64 - log2(cap) */
    hset_t *sets;      /* by id; id 0 unused */
    uint32_t nsets;    /* ids handed out so far + 1 */
    uint32_t setcap;
    uint32_t *free_ids;
    uint32_t nfree, freecap;
    uint64_t gen; /* bumped whenever a set is freed: cached moves are then stale */
    move_t *moves;
    PyObject *ids;  /* dict: bitset -> its id (a set is stored once) */
    PyObject *dups; /* dict: (hash, col) -> repeats above one */
    PyObject *columns;
    Py_ssize_t members_max;
} BlockTable;

/* ---- the slot table ---------------------------------------------------------------------- */

static inline size_t
home(const BlockTable *t, uint64_t h)
{
    return (size_t)((h * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

/* The slot holding h, or -(insertion slot) - 1. */
static inline Py_ssize_t
find(const BlockTable *t, uint64_t h)
{
    size_t mask = t->cap - 1, i = home(t, h);
    const slot_t *s = t->slots;
    while (s[i].set) {
        if (s[i].key == h)
            return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
    return -(Py_ssize_t)i - 1;
}

static int
resize(BlockTable *t, size_t cap)
{
    slot_t *old = t->slots, *fresh = PyMem_Calloc(cap, sizeof(slot_t));
    size_t oldcap = t->cap;
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int bits = 0;
    while (((size_t)1 << bits) < cap)
        bits++;
    t->slots = fresh;
    t->cap = cap;
    t->shift = 64 - bits;
    for (size_t i = 0; i < oldcap; i++)
        if (old[i].set) {
            size_t j = home(t, old[i].key);
            while (fresh[j].set)
                j = (j + 1) & (cap - 1);
            fresh[j] = old[i];
        }
    PyMem_Free(old);
    return 0;
}

/* Room for `more` new blocks at a load of at most 3/4. */
static int
reserve(BlockTable *t, size_t more)
{
    size_t cap = t->cap;
    while ((t->count + more) * 4 > cap * 3)
        cap <<= 1;
    return cap == t->cap ? 0 : resize(t, cap);
}

/* Give memory back once the table is at most 1/8 full (after removals). */
static int
shrink(BlockTable *t)
{
    size_t cap = t->cap;
    while (cap > 1024 && t->count * 8 < cap)
        cap >>= 1;
    return cap == t->cap ? 0 : resize(t, cap);
}

/* Empty slot i, shifting back the slots after it that probed past it. */
static void
delete_slot(BlockTable *t, size_t i)
{
    size_t mask = t->cap - 1, j = i;
    slot_t *s = t->slots;
    s[i].set = 0;
    for (;;) {
        j = (j + 1) & mask;
        if (!s[j].set)
            break;
        size_t k = home(t, s[j].key);
        /* slot j may stay when its home lies cyclically in (i, j] */
        if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
            continue;
        s[i] = s[j];
        s[j].set = 0;
        i = j;
    }
    t->count--;
}

/* ---- holder sets ------------------------------------------------------------------------- */

/* A non-negative int's bits as words (*words: PyMem, caller frees); -1 on error. */
static int
int_words(PyObject *v, uint64_t **words, Py_ssize_t *nwords)
{
    PyObject *nb = PyObject_CallMethod(v, "bit_length", NULL);
    if (nb == NULL)
        return -1;
    Py_ssize_t bits = PyLong_AsSsize_t(nb);
    Py_DECREF(nb);
    if (bits < 0)
        return -1;
    Py_ssize_t n = (bits + 63) / 64;
    PyObject *b = PyObject_CallMethod(v, "to_bytes", "ns", 8 * n, "little");
    if (b == NULL)
        return -1;
    uint64_t *w = PyMem_Calloc((size_t)(n ? n : 1), sizeof(uint64_t));
    if (w == NULL) {
        Py_DECREF(b);
        PyErr_NoMemory();
        return -1;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(b);
    for (Py_ssize_t i = 0; i < n; i++)
        for (int k = 0; k < 8; k++)
            w[i] |= (uint64_t)p[8 * i + k] << (8 * k);
    Py_DECREF(b);
    *words = w;
    *nwords = n;
    return 0;
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

static inline int
set_has(const BlockTable *t, uint32_t id, Py_ssize_t col)
{
    const hset_t *s = &t->sets[id];
    return (col >> 6) < s->nwords && (s->words[col >> 6] >> (col & 63)) & 1;
}

/* The id of bitset v (non-zero), stored now if it is new (with no block yet); 0 on error. */
static uint32_t
set_id(BlockTable *t, PyObject *v)
{
    PyObject *got = PyDict_GetItemWithError(t->ids, v);
    if (got != NULL)
        return (uint32_t)PyLong_AsUnsignedLong(got);
    if (PyErr_Occurred())
        return 0;
    uint32_t id;
    if (t->nfree) {
        id = t->free_ids[--t->nfree];
    } else {
        if (t->nsets == UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "too many holder sets");
            return 0;
        }
        if (t->nsets == t->setcap) {
            uint32_t cap = t->setcap * 2;
            hset_t *grown = PyMem_Realloc(t->sets, sizeof(hset_t) * cap);
            if (grown == NULL) {
                PyErr_NoMemory();
                return 0;
            }
            t->sets = grown;
            t->setcap = cap;
        }
        id = t->nsets++;
    }
    hset_t *s = &t->sets[id];
    memset(s, 0, sizeof(*s));
    if (int_words(v, &s->words, &s->nwords) < 0)
        goto error;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < s->nwords; i++)
        n += __builtin_popcountll(s->words[i]);
    s->cols = PyMem_Malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (s->cols == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < s->nwords; i++)
        for (uint64_t w = s->words[i]; w; w &= w - 1)
            s->cols[s->ncols++] = (int32_t)(64 * i + __builtin_ctzll(w));
    PyObject *idobj = PyLong_FromUnsignedLong(id);
    if (idobj == NULL || PyDict_SetItem(t->ids, v, idobj) < 0) {
        Py_XDECREF(idobj);
        goto error;
    }
    Py_DECREF(idobj);
    s->bits = Py_NewRef(v);
    return id;
error:
    PyMem_Free(s->words);
    PyMem_Free(s->cols);
    memset(s, 0, sizeof(*s));
    t->free_ids[t->nfree++] = id; /* room: ids freed never exceed ids handed out */
    return 0;
}

static int
free_id_room(BlockTable *t)
{
    if (t->nfree < t->freecap)
        return 0;
    uint32_t cap = t->freecap * 2;
    uint32_t *grown = PyMem_Realloc(t->free_ids, sizeof(uint32_t) * cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->free_ids = grown;
    t->freecap = cap;
    return 0;
}

/* One block fewer holds set id; the set goes with its last block. */
static int
unref(BlockTable *t, uint32_t id)
{
    hset_t *s = &t->sets[id];
    if (--s->refs > 0)
        return 0;
    if (free_id_room(t) < 0)
        return -1;
    int rc = PyDict_DelItem(t->ids, s->bits);
    Py_CLEAR(s->bits);
    PyMem_Free(s->words);
    PyMem_Free(s->cols);
    memset(s, 0, sizeof(*s));
    t->free_ids[t->nfree++] = id;
    t->gen++;
    return rc;
}

/* The set a block of set `from` (0: none) moves to when it gains (add) or loses column
 * col: 0 when it loses its last column, (uint32_t)-1 on error. */
static uint32_t
move(BlockTable *t, uint32_t from, Py_ssize_t col, int add)
{
    move_t *m = &t->moves[((uint64_t)from * 2654435761u + (uint64_t)col * 2 + (uint64_t)add) &
                          (MOVES - 1)];
    if (m->gen == t->gen && m->from == from && m->col == col && m->add == add)
        return m->to;
    PyObject *one = PyLong_FromLong(1), *colobj = PyLong_FromSsize_t(col), *bit = NULL,
             *nv = NULL;
    uint32_t to = (uint32_t)-1;
    if (one == NULL || colobj == NULL || (bit = PyNumber_Lshift(one, colobj)) == NULL)
        goto done;
    if (from == 0)
        nv = Py_NewRef(bit);
    else
        nv = (add ? PyNumber_Or : PyNumber_Xor)(t->sets[from].bits, bit);
    if (nv == NULL)
        goto done;
    int nonzero = PyObject_IsTrue(nv);
    if (nonzero < 0)
        goto done;
    if (!nonzero) {
        to = 0;
    } else {
        /* a new id needs room in free_ids should it be given back on an error */
        if (free_id_room(t) < 0)
            goto done;
        to = set_id(t, nv);
        if (to == 0)
            to = (uint32_t)-1;
    }
    if (to != (uint32_t)-1) {
        m->from = from;
        m->to = to;
        m->col = (int32_t)col;
        m->add = add;
        m->gen = t->gen;
    }
done:
    Py_XDECREF(one);
    Py_XDECREF(colobj);
    Py_XDECREF(bit);
    Py_XDECREF(nv);
    return to;
}

/* Slot pos (holding a block of set `from`) moves to set `to` (0: the block goes). */
static int
rehome(BlockTable *t, size_t pos, uint32_t from, uint32_t to)
{
    if (to) {
        t->sets[to].refs++;
        t->slots[pos].set = to;
    } else {
        delete_slot(t, pos);
    }
    return unref(t, from);
}

/* ---- arguments --------------------------------------------------------------------------- */

/* hashes as u64 (PyMem, caller frees): 1; 0 when one is not an exact int in [0, 2**64) or
 * hashes is not a list (the caller returns None); -1 with an exception. */
static int
u64_list(PyObject *hashes, uint64_t **out)
{
    *out = NULL;
    if (!PyList_CheckExact(hashes))
        return 0;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    uint64_t *k = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (k == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(hashes, i);
        if (!PyLong_CheckExact(h)) {
            PyMem_Free(k);
            return 0;
        }
        k[i] = PyLong_AsUnsignedLongLong(h);
        if (k[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyMem_Free(k);
            return 0;
        }
    }
    *out = k;
    return 1;
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

/* ---- lookup ------------------------------------------------------------------------------ */

typedef struct {
    uint32_t local; /* the holder set's place among this lookup's */
    Py_ssize_t start, len;
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

PyDoc_STRVAR(lookup_doc,
"lookup(hashes, keep, owner) -> dict | None\n\n"
"Per column, the mask of the positions of hashes whose holder set has it (kept columns\n"
"only: keep is a bitset, -1 for all): {owner[col][0]: {owner[col][1]: mask}} (owner[col]\n"
"None: left out). None when hashes is not a list of exact ints: call again with wire\n"
"ints. One pass over the prompt, each slot prefetched a few positions ahead.");

static PyObject *
BlockTable_lookup(BlockTable *t, PyObject *args)
{
    PyObject *hashes, *keep, *owner;
    if (!PyArg_ParseTuple(args, "O!OO!", &PyList_Type, &hashes, &keep, &PyList_Type, &owner))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes), ncols = PyList_GET_SIZE(owner);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(hashes, i)))
            Py_RETURN_NONE;
    Py_ssize_t words = (n + 63) / 64;
    uint64_t *keys = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    uint32_t *ids = PyMem_Malloc(sizeof(uint32_t) * (size_t)(n ? n : 1));
    uint32_t *local = PyMem_Calloc(t->nsets, sizeof(uint32_t)); /* id -> place + 1 */
    uint32_t *held = PyMem_Malloc(sizeof(uint32_t) * (size_t)(n ? n : 1)); /* place -> id */
    run_t *runs = PyMem_Malloc(sizeof(run_t) * (size_t)(n ? n : 1));
    uint64_t *kept = NULL, *pos = NULL, *bufs = NULL;
    Py_ssize_t nkept = 0, nruns = 0, nh = 0, ntouched = 0;
    int keep_all = 0, invert = 0;
    Py_ssize_t *order = NULL;
    uint32_t *touched = NULL;
    unsigned char *scratch = NULL;
    PyObject *out = PyDict_New();
    if (keys == NULL || ids == NULL || local == NULL || held == NULL || runs == NULL ||
        out == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto error;
    }
    /* 1. The slots, prefetched ahead; a hash outside u64 is held by no one. */
    for (Py_ssize_t i = 0; i < n; i++) {
        keys[i] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(hashes, i));
        if (keys[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            keys[i] = 0;
            ids[i] = (uint32_t)-1; /* absent, whatever key 0 holds */
        } else {
            ids[i] = 0;
        }
    }
    for (Py_ssize_t i = 0; i < n && i < PREFETCH; i++)
        __builtin_prefetch(&t->slots[home(t, keys[i])]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n)
            __builtin_prefetch(&t->slots[home(t, keys[i + PREFETCH])]);
        if (ids[i]) {
            ids[i] = 0;
            continue;
        }
        Py_ssize_t p = find(t, keys[i]);
        ids[i] = p >= 0 ? t->slots[p].set : 0;
    }
    /* 2. Runs of one holder set (ids are exact: one id per distinct set). */
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = i + 1;
        while (j < n && ids[j] == ids[i])
            j++;
        uint32_t id = ids[i];
        if (id) {
            if (!local[id]) {
                held[nh] = id;
                local[id] = (uint32_t)++nh;
            }
            runs[nruns].local = local[id] - 1;
            runs[nruns].start = i;
            runs[nruns].len = j - i;
            nruns++;
        }
        i = j;
    }
    if (nh == 0)
        goto done;
    /* 3. The kept columns as words (keep < 0: its complement's bits are left out). */
    {
        PyObject *k = keep;
        PyObject *zero = PyLong_FromLong(0);
        int neg = zero == NULL ? -1 : PyObject_RichCompareBool(keep, zero, Py_LT);
        Py_XDECREF(zero);
        if (neg < 0)
            goto error;
        if (neg) {
            invert = 1;
            k = PyNumber_Invert(keep);
            if (k == NULL)
                goto error;
        } else {
            Py_INCREF(k);
        }
        int rc = int_words(k, &kept, &nkept);
        Py_DECREF(k);
        if (rc < 0)
            goto error;
        keep_all = invert && nkept == 0;
    }
    pos = PyMem_Calloc((size_t)(nh * words), sizeof(uint64_t));
    touched = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof(uint32_t));
    order = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(ncols ? ncols : 1));
    if (pos == NULL || touched == NULL || order == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t r = 0; r < nruns; r++)
        set_range(pos + (Py_ssize_t)runs[r].local * words, runs[r].start, runs[r].len);
    for (Py_ssize_t h = 0; h < nh; h++) {
        const hset_t *s = &t->sets[held[h]];
        for (Py_ssize_t k = 0; k < s->ncols; k++) {
            Py_ssize_t c = s->cols[k];
            if (!keep_all) {
                int in = (c >> 6) < nkept && (kept[c >> 6] >> (c & 63)) & 1;
                if (in == invert)
                    continue;
            }
            if (c >= ncols) {
                PyErr_SetString(PyExc_IndexError, "column without an owner entry");
                goto error;
            }
            if (!touched[c]) {
                order[ntouched] = c;
                touched[c] = (uint32_t)++ntouched;
            }
        }
    }
    /* 4. Per column, the OR of its holder sets' positions; then the owners' dicts. */
    bufs = PyMem_Calloc((size_t)((ntouched ? ntouched : 1) * words), sizeof(uint64_t));
    scratch = PyMem_Malloc((size_t)(8 * words));
    if (bufs == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t h = 0; h < nh; h++) {
        const uint64_t *src = pos + h * words;
        const hset_t *s = &t->sets[held[h]];
        for (Py_ssize_t k = 0; k < s->ncols; k++) {
            Py_ssize_t c = s->cols[k];
            if (c >= ncols || !touched[c])
                continue;
            uint64_t *dst = bufs + (Py_ssize_t)(touched[c] - 1) * words;
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
    PyMem_Free(keys);
    PyMem_Free(ids);
    PyMem_Free(local);
    PyMem_Free(held);
    PyMem_Free(runs);
    PyMem_Free(kept);
    PyMem_Free(pos);
    PyMem_Free(bufs);
    PyMem_Free(order);
    PyMem_Free(touched);
    PyMem_Free(scratch);
    return out;
error:
    Py_CLEAR(out);
    goto done;
}

/* ---- events ------------------------------------------------------------------------------ */

/* Each stored / removed block is a probe and a move between holder sets (cached); in
 * Python a loop of bytecodes per block. Every hash must be an exact int in [0, 2**64):
 * otherwise None and nothing is changed (the caller converts and calls again). */

static int
column_arg(PyObject *args, Py_ssize_t *col, PyObject **hashes)
{
    if (!PyArg_ParseTuple(args, "nO", col, hashes))
        return -1;
    if (*col < 0 || *col > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "column must be in [0, 2**31)");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(store_doc,
"store(col, hashes) -> (stored, new: bytes) | None\n\n"
"Column col holds each hash once more: its holder set gains col, or a repeat is\n"
"counted. new: the hashes it did not hold before, native uint64, for the column's log.\n"
"None: hashes is not a list of exact u64 ints (nothing changed; call again with them).");

static PyObject *
BlockTable_store(BlockTable *t, PyObject *args)
{
    PyObject *hashes, *colobj = NULL, *out = NULL;
    Py_ssize_t col;
    uint64_t *keys;
    if (column_arg(args, &col, &hashes) < 0)
        return NULL;
    int ok = u64_list(hashes, &keys);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n = PyList_GET_SIZE(hashes), fresh = 0;
    out = PyBytes_FromStringAndSize(NULL, 8 * (n ? n : 1));
    colobj = PyLong_FromSsize_t(col);
    if (out == NULL || colobj == NULL || reserve(t, (size_t)n) < 0)
        goto error;
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = keys[i];
        Py_ssize_t p = find(t, h);
        uint32_t from = 0;
        if (p >= 0) {
            from = t->slots[p].set;
            if (set_has(t, from, col)) { /* a repeat of a block the column holds */
                if (bump_repeat(t->dups, PyList_GET_ITEM(hashes, i), colobj, +1) < 0)
                    goto error;
                continue;
            }
        }
        uint32_t to = move(t, from, col, 1);
        if (to == (uint32_t)-1)
            goto error;
        if (p >= 0) {
            if (rehome(t, (size_t)p, from, to) < 0)
                goto error;
        } else {
            size_t at = (size_t)(-p - 1);
            t->slots[at].key = h;
            t->slots[at].set = to;
            t->sets[to].refs++;
            t->count++;
        }
        dst[fresh++] = h;
    }
    if (_PyBytes_Resize(&out, 8 * fresh) < 0)
        goto error;
    PyMem_Free(keys);
    Py_DECREF(colobj);
    return Py_BuildValue("(nN)", n, out);
error:
    PyMem_Free(keys);
    Py_XDECREF(out);
    Py_XDECREF(colobj);
    return NULL;
}

PyDoc_STRVAR(remove_doc,
"remove(col, hashes) -> (done, released) | None\n\n"
"Column col releases each hash once: a repeat is taken back first, else col leaves its\n"
"holder set (the block goes with its last column). done: hashes the column held;\n"
"released: those it no longer holds. None: as store.");

static PyObject *
BlockTable_remove(BlockTable *t, PyObject *args)
{
    PyObject *hashes, *colobj = NULL;
    Py_ssize_t col, done = 0, released = 0;
    uint64_t *keys;
    if (column_arg(args, &col, &hashes) < 0)
        return NULL;
    int ok = u64_list(hashes, &keys);
    if (ok <= 0)
        return ok < 0 ? NULL : Py_NewRef(Py_None);
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if ((colobj = PyLong_FromSsize_t(col)) == NULL)
        goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t p = find(t, keys[i]);
        if (p < 0)
            continue;
        uint32_t from = t->slots[p].set;
        if (!set_has(t, from, col))
            continue;
        done++;
        if (PyDict_GET_SIZE(t->dups)) { /* a repeat to take back first (rare: none at all) */
            int r = bump_repeat(t->dups, PyList_GET_ITEM(hashes, i), colobj, -1);
            if (r < 0)
                goto error;
            if (r)
                continue;
        }
        uint32_t to = move(t, from, col, 0);
        if (to == (uint32_t)-1 || rehome(t, (size_t)p, from, to) < 0)
            goto error;
        released++;
    }
    if (shrink(t) < 0)
        goto error;
    PyMem_Free(keys);
    Py_DECREF(colobj);
    return Py_BuildValue("(nn)", done, released);
error:
    PyMem_Free(keys);
    Py_XDECREF(colobj);
    return NULL;
}

PyDoc_STRVAR(compact_doc,
"compact(col, log) -> bytes\n\n"
"Of a column's log (native uint64 hashes, bytes-like), the hashes the column still\n"
"holds, each once, in first-seen order.");

/* The (col, log) arguments of compact and drop: a column and its log, a bytes-like of
 * native uint64 hashes (the caller releases log with PyBuffer_Release). */
typedef struct {
    Py_ssize_t col;
    Py_buffer log;
    Py_ssize_t n; /* hashes in the log */
} ColumnLog;

static int
column_log_parse(PyObject *args, ColumnLog *cl)
{
    if (!PyArg_ParseTuple(args, "ny*", &cl->col, &cl->log))
        return -1;
    cl->n = cl->log.len / 8;
    return 0;
}

static inline uint64_t
column_log_at(const ColumnLog *cl, Py_ssize_t i)
{
    uint64_t h;
    memcpy(&h, (const char *)cl->log.buf + 8 * i, 8);
    return h;
}

static PyObject *
BlockTable_compact(BlockTable *t, PyObject *args)
{
    Py_ssize_t cap = 16, kept = 0;
    ColumnLog cl;
    if (column_log_parse(args, &cl) < 0)
        return NULL;
    Py_ssize_t n = cl.n, col = cl.col;
    while (cap < 2 * n)
        cap <<= 1;
    uint64_t *seen = PyMem_Calloc((size_t)cap, sizeof(uint64_t));
    unsigned char *used = PyMem_Calloc((size_t)cap, 1);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * (n ? n : 1));
    if (seen == NULL || used == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    if (out == NULL)
        goto error;
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = column_log_at(&cl, i);
        Py_ssize_t j = (Py_ssize_t)((h * 0x9E3779B97F4A7C15ULL) >> 1) & (cap - 1);
        while (used[j] && seen[j] != h)
            j = (j + 1) & (cap - 1);
        if (used[j])
            continue; /* logged again after a removal: kept once */
        used[j] = 1;
        seen[j] = h;
        Py_ssize_t p = find(t, h);
        if (p >= 0 && set_has(t, t->slots[p].set, col))
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
    PyBuffer_Release(&cl.log);
    return out;
}

PyDoc_STRVAR(drop_doc,
"drop(col, log) -> None\n\n"
"Column col goes: every hash of its log (native uint64, bytes-like) loses col and the\n"
"column's repeats are forgotten. O(len(log)) plus O(repeats).");

static PyObject *
BlockTable_drop(BlockTable *t, PyObject *args)
{
    PyObject *colobj = NULL, *gone = NULL, *out = NULL;
    ColumnLog cl;
    if (column_log_parse(args, &cl) < 0)
        return NULL;
    Py_ssize_t col = cl.col;
    if ((colobj = PyLong_FromSsize_t(col)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < cl.n; i++) {
        uint64_t h = column_log_at(&cl, i);
        Py_ssize_t p = find(t, h);
        if (p < 0)
            continue;
        uint32_t from = t->slots[p].set;
        if (!set_has(t, from, col))
            continue;
        uint32_t to = move(t, from, col, 0);
        if (to == (uint32_t)-1 || rehome(t, (size_t)p, from, to) < 0)
            goto done;
    }
    if (PyDict_GET_SIZE(t->dups)) {
        gone = PyList_New(0);
        if (gone == NULL)
            goto done;
        PyObject *k, *v;
        Py_ssize_t it = 0;
        while (PyDict_Next(t->dups, &it, &k, &v)) {
            int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(k, 1), colobj, Py_EQ);
            if (eq < 0 || (eq && PyList_Append(gone, k) < 0))
                goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gone); i++)
            if (PyDict_DelItem(t->dups, PyList_GET_ITEM(gone, i)) < 0)
                goto done;
    }
    if (shrink(t) < 0)
        goto done;
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(gone);
    Py_XDECREF(colobj);
    PyBuffer_Release(&cl.log);
    return out;
}

PyDoc_STRVAR(trim_interned_doc,
"trim_interned(limit) -> None\n\n"
"Nothing to do here: each holder set is stored once and goes with its last block.");

static PyObject *
BlockTable_trim_interned(BlockTable *t, PyObject *arg)
{
    if (PyLong_AsSsize_t(arg) == -1 && PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(duplicates_doc, "duplicates() -> int\n\nRepeats above one, summed.");

static PyObject *
BlockTable_duplicates(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    long long total = 0;
    while (PyDict_Next(t->dups, &pos, &k, &v)) {
        long long x = PyLong_AsLongLong(v);
        if (x == -1 && PyErr_Occurred())
            return NULL;
        total += x;
    }
    return PyLong_FromLongLong(total);
}

PyDoc_STRVAR(snapshot_doc,
"snapshot() -> (blocks, dups)\n\n"
"Copies of the table's state, {hash: bitset} and {(hash, col): repeats} (tests).");

static PyObject *
BlockTable_snapshot(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *blocks = PyDict_New();
    if (blocks == NULL)
        return NULL;
    for (size_t i = 0; i < t->cap; i++) {
        if (!t->slots[i].set)
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(t->slots[i].key);
        int rc = k == NULL ? -1 : PyDict_SetItem(blocks, k, t->sets[t->slots[i].set].bits);
        Py_XDECREF(k);
        if (rc < 0) {
            Py_DECREF(blocks);
            return NULL;
        }
    }
    return Py_BuildValue("(NN)", blocks, PyDict_Copy(t->dups));
}

PyDoc_STRVAR(holders_doc,
"holders(h) -> int\n\nThe bitset of the columns holding wire hash h (0: none).");

static PyObject *
BlockTable_holders(BlockTable *t, PyObject *h)
{
    if (!PyLong_Check(h)) {
        PyErr_SetString(PyExc_TypeError, "holders() takes a wire hash (an int)");
        return NULL;
    }
    uint64_t k = PyLong_AsUnsignedLongLong(h);
    if (k == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* outside u64: no block has it */
        return PyLong_FromLong(0);
    }
    Py_ssize_t p = find(t, k);
    if (p < 0)
        return PyLong_FromLong(0);
    return Py_NewRef(t->sets[t->slots[p].set].bits);
}

static Py_ssize_t
BlockTable_len(BlockTable *t)
{
    return (Py_ssize_t)t->count;
}

PyDoc_STRVAR(memory_doc,
"memory() -> dict\n\nBytes the table allocated: slots, holder sets (and how many).");

static PyObject *
BlockTable_memory(BlockTable *t, PyObject *Py_UNUSED(ignored))
{
    size_t sets = sizeof(hset_t) * t->setcap, live = 0;
    for (uint32_t id = 1; id < t->nsets; id++) {
        const hset_t *s = &t->sets[id];
        if (s->bits == NULL)
            continue;
        live++;
        sets += sizeof(uint64_t) * (size_t)s->nwords + sizeof(int32_t) * (size_t)s->ncols;
    }
    return Py_BuildValue("{s:n,s:n,s:n,s:n}", "slots_bytes", (Py_ssize_t)(t->cap * sizeof(slot_t)),
                         "capacity", (Py_ssize_t)t->cap, "sets_bytes", (Py_ssize_t)sets,
                         "sets", (Py_ssize_t)live);
}

static PyObject *
BlockTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *columns;
    Py_ssize_t members_max;
    static char *kwlist[] = {"columns", "members_max", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "On", kwlist, &columns, &members_max))
        return NULL;
    if (!PyCallable_Check(columns)) {
        PyErr_SetString(PyExc_TypeError, "columns must be callable");
        return NULL;
    }
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->cap = 1024;
    t->shift = 64 - 10;
    t->slots = PyMem_Calloc(t->cap, sizeof(slot_t));
    t->setcap = 64;
    t->nsets = 1; /* id 0: no set */
    t->sets = PyMem_Calloc(t->setcap, sizeof(hset_t));
    t->freecap = 64;
    t->free_ids = PyMem_Malloc(sizeof(uint32_t) * t->freecap);
    t->moves = PyMem_Calloc(MOVES, sizeof(move_t));
    t->gen = 1; /* calloc'd moves (gen 0) are stale */
    t->ids = PyDict_New();
    t->dups = PyDict_New();
    t->columns = Py_NewRef(columns);
    t->members_max = members_max;
    if (!t->slots || !t->sets || !t->free_ids || !t->moves || !t->ids || !t->dups) {
        Py_DECREF(t);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void
BlockTable_dealloc(BlockTable *t)
{
    if (t->sets != NULL)
        for (uint32_t id = 1; id < t->nsets; id++) {
            Py_XDECREF(t->sets[id].bits);
            PyMem_Free(t->sets[id].words);
            PyMem_Free(t->sets[id].cols);
        }
    PyMem_Free(t->sets);
    PyMem_Free(t->slots);
    PyMem_Free(t->free_ids);
    PyMem_Free(t->moves);
    Py_XDECREF(t->ids);
    Py_XDECREF(t->dups);
    Py_XDECREF(t->columns);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef BlockTable_methods[] = {
    {"store", (PyCFunction)BlockTable_store, METH_VARARGS, store_doc},
    {"remove", (PyCFunction)BlockTable_remove, METH_VARARGS, remove_doc},
    {"compact", (PyCFunction)BlockTable_compact, METH_VARARGS, compact_doc},
    {"drop", (PyCFunction)BlockTable_drop, METH_VARARGS, drop_doc},
    {"lookup", (PyCFunction)BlockTable_lookup, METH_VARARGS, lookup_doc},
    {"holders", (PyCFunction)BlockTable_holders, METH_O, holders_doc},
    {"trim_interned", (PyCFunction)BlockTable_trim_interned, METH_O, trim_interned_doc},
    {"duplicates", (PyCFunction)BlockTable_duplicates, METH_NOARGS, duplicates_doc},
    {"snapshot", (PyCFunction)BlockTable_snapshot, METH_NOARGS, snapshot_doc},
    {"memory", (PyCFunction)BlockTable_memory, METH_NOARGS, memory_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods BlockTable_as_sequence = {
    .sq_length = (lenfunc)BlockTable_len,
};

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "router.index._memindex.BlockTable",
    .tp_doc = "The memory index's block table (router.index.table.PyBlockTable is the "
              "reference).",
    .tp_basicsize = sizeof(BlockTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = BlockTable_new,
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_methods = BlockTable_methods,
    .tp_as_sequence = &BlockTable_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router.index._memindex",
    "The memory index's block table in C (router.index.table is the reference).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__memindex(void)
{
    if (PyType_Ready(&BlockTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
