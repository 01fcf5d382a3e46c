/* router.index._memindex: the memory index's block table, its storage and the loops over it.
 *
 * BlockTable owns the memory index's per-block state: blocks (wire hash -> bitset of the
 * columns holding it, an int interned through ints so blocks sharing a holder set share
 * one object), dups ((hash, column) -> repeats above one: vLLM does not deduplicate
 * physical blocks) and the lookup's memo of each holder set's columns. router.index.memory
 * (MemoryIndex) keeps the rest -- instances, columns, per-column logs, cursors -- and
 * reaches the table only through the API below, which router.index.table.PyBlockTable
 * implements in Python, the reference; tests/router/test_index_table.py runs random event
 * streams through both and compares their whole state.
 *
 * Why in C: applying events as Python loops was ~2x slower (465k vs 947k block events/s
 * in one interleaved run), and the lookup's transpose ~1.3x.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *blocks;  /* dict: wire hash -> bitset of columns (interned) */
    PyObject *ints;    /* dict: bitset -> itself, the interning table */
    PyObject *dups;    /* dict: (hash, col) -> repeats above one */
    PyObject *members; /* dict: holder set (kept columns) -> its columns, a tuple */
    PyObject *columns; /* callable: bitset -> tuple of its columns, ascending */
    Py_ssize_t members_max;
} BlockTable;

/* ---- lookup ----------------------------------------------------------------------------- */

/* A lookup wants the transpose of the table: per column, the mask of the request's
 * positions it holds. In Python that is a step per (run of one holder set, column) pair
 * and one per column; here the positions are ORed as 64-bit words. */

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

PyDoc_STRVAR(lookup_doc,
"lookup(hashes, keep, owner) -> dict | None\n\n"
"Per column, the mask of the positions of hashes whose holder set has it (kept columns\n"
"only): {owner[col][0]: {owner[col][1]: mask}} (owner[col] None: left out). None when\n"
"hashes is not a list of exact ints: call again with wire ints.");

static PyObject *
BlockTable_lookup(BlockTable *t, PyObject *args)
{
    PyObject *hashes, *keep, *owner;
    if (!PyArg_ParseTuple(args, "O!OO!", &PyList_Type, &hashes, &keep, &PyList_Type, &owner))
        return NULL;
    PyObject *blocks = t->blocks, *members = t->members, *columns = t->columns;
    Py_ssize_t members_max = t->members_max;
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

/* ---- events ----------------------------------------------------------------------------- */

/* Each stored / removed block is a few dict steps on the table's own dicts; in Python a
 * loop of bytecodes per block (under an engine's eviction churn a fifth of the router's
 * CPU), here one C loop. Every hash must be an exact int in [0, 2**64): otherwise None and
 * nothing is changed (the caller converts and calls again). */

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

/* store's and remove's arguments: 1, 0 (a hash that is not an exact u64 int: the
 * caller returns None) or -1 with an exception set. */
static int
apply_args(BlockTable *t, PyObject *args, PyObject **blocks, PyObject **ints,
           PyObject **dups, Py_ssize_t *col, PyObject **hashes)
{
    if (!PyArg_ParseTuple(args, "nO", col, hashes))
        return -1;
    if (*col < 0) {
        PyErr_SetString(PyExc_ValueError, "column must be >= 0");
        return -1;
    }
    *blocks = t->blocks;
    *ints = t->ints;
    *dups = t->dups;
    return exact_u64_list(*hashes);
}

PyDoc_STRVAR(store_doc,
"store(col, hashes) -> (stored, new: bytes) | None\n\n"
"Column col holds each hash once more: its bitset gains 1 << col, or a repeat is\n"
"counted. new: the hashes it did not hold before, native uint64, for the column's log.\n"
"None: hashes is not a list of exact u64 ints (nothing changed; call again with them).");

static PyObject *
BlockTable_store(BlockTable *t, PyObject *args)
{
    PyObject *blocks, *ints, *dups, *hashes;
    Py_ssize_t col;
    int ok = apply_args(t, args, &blocks, &ints, &dups, &col, &hashes);
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

PyDoc_STRVAR(remove_doc,
"remove(col, hashes) -> (done, released) | None\n\n"
"Column col releases each hash once: a repeat is taken back first, else the bit goes\n"
"(the block goes with its last column). done: hashes the column held; released: those\n"
"it no longer holds. None: as store.");

static PyObject *
BlockTable_remove(BlockTable *t, PyObject *args)
{
    PyObject *blocks, *ints, *dups, *hashes;
    Py_ssize_t col;
    int ok = apply_args(t, args, &blocks, &ints, &dups, &col, &hashes);
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

PyDoc_STRVAR(compact_doc,
"compact(col, log) -> bytes\n\n"
"Of a column's log (native uint64 hashes, bytes-like), the hashes the column still\n"
"holds, each once, in first-seen order.");

static PyObject *
BlockTable_compact(BlockTable *t, PyObject *args)
{
    PyObject *blocks = t->blocks;
    Py_ssize_t col;
    Py_buffer log;
    if (!PyArg_ParseTuple(args, "ny*", &col, &log))
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

PyDoc_STRVAR(drop_doc,
"drop(col, log) -> None\n\n"
"Column col goes: every hash of its log (native uint64, bytes-like) loses 1 << col and\n"
"the column's repeats are forgotten. O(len(log)) plus O(repeats).");

static PyObject *
BlockTable_drop(BlockTable *t, PyObject *args)
{
    Py_ssize_t col;
    Py_buffer log;
    if (!PyArg_ParseTuple(args, "ny*", &col, &log))
        return NULL;
    PyObject *colobj = NULL, *bit = NULL, *gone = NULL;
    PyObject *out = NULL;
    if (column_bit(col, &colobj, &bit) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < log.len / 8; i++) {
        uint64_t h;
        memcpy(&h, (const char *)log.buf + 8 * i, 8);
        PyObject *key = PyLong_FromUnsignedLongLong(h), *v;
        if (key == NULL)
            goto done;
        int held = column_holds(t->blocks, key, bit, &v);
        int rc = 0;
        if (held > 0) {
            PyObject *nv = PyNumber_Xor(v, bit);
            int nonzero = nv == NULL ? -1 : PyObject_IsTrue(nv);
            if (nonzero > 0)
                rc = set_interned(t->blocks, t->ints, key, nv);
            else {
                Py_XDECREF(nv);
                rc = nonzero < 0 ? -1 : PyDict_DelItem(t->blocks, key);
            }
        }
        Py_DECREF(key);
        if (held < 0 || rc < 0)
            goto done;
    }
    if (PyDict_GET_SIZE(t->dups)) {
        gone = PyList_New(0);
        if (gone == NULL)
            goto done;
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(t->dups, &pos, &k, &v)) {
            int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(k, 1), colobj, Py_EQ);
            if (eq < 0 || (eq && PyList_Append(gone, k) < 0))
                goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gone); i++)
            if (PyDict_DelItem(t->dups, PyList_GET_ITEM(gone, i)) < 0)
                goto done;
    }
    out = Py_NewRef(Py_None);
done:
    Py_XDECREF(gone);
    Py_XDECREF(colobj);
    Py_XDECREF(bit);
    PyBuffer_Release(&log);
    return out;
}

PyDoc_STRVAR(trim_interned_doc,
"trim_interned(limit) -> None\n\n"
"Forget the interning table once it holds more than limit bitsets (only future bitsets\n"
"lose their sharing).");

static PyObject *
BlockTable_trim_interned(BlockTable *t, PyObject *arg)
{
    Py_ssize_t limit = PyLong_AsSsize_t(arg);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (PyDict_GET_SIZE(t->ints) > limit)
        PyDict_Clear(t->ints);
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
    return Py_BuildValue("(NN)", PyDict_Copy(t->blocks), PyDict_Copy(t->dups));
}

PyDoc_STRVAR(holders_doc,
"holders(h) -> int\n\nThe bitset of the columns holding wire hash h (0: none).");

static PyObject *
BlockTable_holders(BlockTable *t, PyObject *h)
{
    PyObject *v = PyDict_GetItemWithError(t->blocks, h);
    if (v == NULL)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    return Py_NewRef(v);
}

static Py_ssize_t
BlockTable_len(BlockTable *t)
{
    return PyDict_GET_SIZE(t->blocks);
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
    t->blocks = PyDict_New();
    t->ints = PyDict_New();
    t->dups = PyDict_New();
    t->members = PyDict_New();
    t->columns = Py_NewRef(columns);
    t->members_max = members_max;
    if (!t->blocks || !t->ints || !t->dups || !t->members) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
BlockTable_dealloc(BlockTable *t)
{
    Py_XDECREF(t->blocks);
    Py_XDECREF(t->ints);
    Py_XDECREF(t->dups);
    Py_XDECREF(t->members);
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
