/* The simulated engine's GPU block pool and CPU tier in C: what block_pool.py's PyBlockPool and PyCpuTier do, with
 * the same results.
 *
 * Why: the pool's work is per block (a 195K-token context is ~3,000 blocks of 64 tokens, freed and re-referenced
 * every turn), and at 544 engine ranks Python's per-block loops were a quarter of the cluster simulator's time.
 *
 * State: ref counts, the free queue as vLLM's FreeKVCacheBlockQueue (a doubly linked list through `prev`/`next`,
 * sentinel at index n: next[n] is the front, evicted first), each block's hash (a bytes object or NULL), and the hash
 * -> block map as a Python dict (`cached`: block id, or {block id: None} when several blocks hold one hash, the
 * first serving hits), shared with Python readers (P2P lookups, invariants).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;       /* blocks, the null block 0 included */
    int32_t *ref;
    int32_t *prev;      /* n + 1 entries: index n is the list's sentinel */
    int32_t *next;
    PyObject **hash;    /* owned references, NULL for an unhashed block */
    Py_ssize_t n_free;
    PyObject *cached;   /* dict */
} Pool;

/* ---- 64-bit hash form ------------------------------------------------------------------------------------------ */

/* int.from_bytes(h, "big") & (2**64 - 1): the last eight bytes, big endian. */
static PyObject *h64_of(PyObject *h) {
    if (!PyBytes_Check(h)) {
        PyErr_SetString(PyExc_TypeError, "block hashes must be bytes");
        return NULL;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(h);
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(h);
    Py_ssize_t k = len < 8 ? len : 8;
    uint64_t x = 0;
    for (Py_ssize_t i = len - k; i < len; i++) x = (x << 8) | p[i];
    return PyLong_FromUnsignedLongLong(x);
}

/* ---- linked lists through prev/next arrays (the pool's free queue, the tier's LRU order) ------------------------ */

static inline void list_unlink(int32_t *prev, int32_t *next, int32_t b) {
    int32_t p = prev[b], q = next[b];
    next[p] = q;
    prev[q] = p;
}

static inline void list_insert_after(int32_t *prev, int32_t *next, int32_t pos, int32_t b) {
    int32_t q = next[pos];
    next[pos] = b;
    prev[b] = pos;
    next[b] = q;
    prev[q] = b;
}

static inline void unlink_block(Pool *s, int32_t b) { list_unlink(s->prev, s->next, b); }
static inline void insert_after(Pool *s, int32_t pos, int32_t b) { list_insert_after(s->prev, s->next, pos, b); }

static int block_arg(Pool *s, PyObject *o, int32_t *out) {
    long b = PyLong_AsLong(o);
    if (b == -1 && PyErr_Occurred()) return -1;
    if (b < 1 || b >= s->n) {
        PyErr_Format(PyExc_IndexError, "block id %ld out of range 1..%zd", b, s->n - 1);
        return -1;
    }
    *out = (int32_t)b;
    return 0;
}

/* ---- the hash map ----------------------------------------------------------------------------------------------- */

/* Drops block b (holding hash h) from the map. */
static int map_remove(Pool *s, int32_t b, PyObject *h) {
    PyObject *v = PyDict_GetItemWithError(s->cached, h); /* borrowed */
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    if (PyLong_CheckExact(v)) {
        if (PyLong_AsLong(v) == b) return PyDict_DelItem(s->cached, h);
        return 0;
    }
    PyObject *key = PyLong_FromLong(b);
    if (key == NULL) return -1;
    int rc = PyDict_Contains(v, key);
    if (rc == 1) rc = PyDict_DelItem(v, key);
    Py_DECREF(key);
    if (rc < 0) return -1;
    if (PyDict_GET_SIZE(v) == 1) {
        Py_ssize_t pos = 0;
        PyObject *k, *val;
        PyDict_Next(v, &pos, &k, &val);
        Py_INCREF(k);
        rc = PyDict_SetItem(s->cached, h, k); /* may free v */
        Py_DECREF(k);
        return rc;
    }
    return 0;
}

/* Adds block b under hash h. */
static int map_add(Pool *s, int32_t b, PyObject *h) {
    PyObject *v = PyDict_GetItemWithError(s->cached, h);
    PyObject *key = PyLong_FromLong(b);
    if (key == NULL) return -1;
    int rc;
    if (v == NULL) {
        rc = PyErr_Occurred() ? -1 : PyDict_SetItem(s->cached, h, key);
    } else if (PyLong_CheckExact(v)) {
        if (PyLong_AsLong(v) == b) {
            rc = 0;
        } else {
            PyObject *d = PyDict_New();
            rc = d == NULL ? -1 : 0;
            if (rc == 0) rc = PyDict_SetItem(d, v, Py_None);
            if (rc == 0) rc = PyDict_SetItem(d, key, Py_None);
            if (rc == 0) rc = PyDict_SetItem(s->cached, h, d);
            Py_XDECREF(d);
        }
    } else {
        rc = PyDict_SetItem(v, key, Py_None);
    }
    Py_DECREF(key);
    return rc;
}

/* ---- the type --------------------------------------------------------------------------------------------------- */

static void Pool_dealloc(Pool *s) {
    if (s->hash != NULL) {
        for (Py_ssize_t i = 0; i < s->n; i++) Py_XDECREF(s->hash[i]);
    }
    PyMem_Free(s->hash);
    PyMem_Free(s->ref);
    PyMem_Free(s->prev);
    PyMem_Free(s->next);
    Py_XDECREF(s->cached);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int Pool_init(Pool *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"num_blocks", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &n)) return -1;
    if (n < 2 || n > INT32_MAX - 1) {
        PyErr_SetString(PyExc_ValueError, "num_blocks must be >= 2 (block 0 is the null block) and fit 31 bits");
        return -1;
    }
    if (s->ref != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "BlockPool is already initialised");
        return -1;
    }
    s->n = n;
    s->ref = PyMem_Calloc((size_t)n, sizeof(int32_t));
    s->prev = PyMem_Calloc((size_t)n + 1, sizeof(int32_t));
    s->next = PyMem_Calloc((size_t)n + 1, sizeof(int32_t));
    s->hash = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    s->cached = PyDict_New();
    if (!s->ref || !s->prev || !s->next || !s->hash || !s->cached) {
        PyErr_NoMemory();
        return -1;
    }
    int32_t S = (int32_t)n;
    s->next[S] = S;
    s->prev[S] = S;
    for (int32_t b = 1; b < S; b++) insert_after(s, s->prev[S], b);
    s->n_free = n - 1;
    return 0;
}

static PyObject *Pool_lookup(Pool *s, PyObject *args) {
    PyObject *hashes;
    Py_ssize_t max_blocks;
    if (!PyArg_ParseTuple(args, "On", &hashes, &max_blocks)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (max_blocks < m) m = max_blocks;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < m; i++) {
        PyObject *v = PyDict_GetItemWithError(s->cached, items[i]);
        if (v == NULL) {
            if (PyErr_Occurred()) Py_CLEAR(out);
            break;
        }
        if (!PyLong_CheckExact(v)) { /* several blocks hold it: the first serves the hit */
            Py_ssize_t pos = 0;
            PyObject *val;
            PyDict_Next(v, &pos, &v, &val);
        }
        if (PyList_Append(out, v) < 0) Py_CLEAR(out);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *Pool_num_evictable(Pool *s, PyObject *blocks) {
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq), k = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t b;
        if (block_arg(s, items[i], &b) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        k += s->ref[b] == 0;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(k);
}

static PyObject *Pool_touch(Pool *s, PyObject *blocks) {
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t b;
        if (block_arg(s, items[i], &b) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (s->ref[b] == 0) { /* a prefix hit on a free block takes it out of the queue */
            unlink_block(s, b);
            s->n_free--;
        }
        s->ref[b]++;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *Pool_take(Pool *s, PyObject *arg) {
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred()) return NULL;
    if (k < 0 || k > s->n_free) {
        PyErr_Format(PyExc_ValueError, "cannot take %zd blocks: %zd are free", k, s->n_free);
        return NULL;
    }
    PyObject *out = PyList_New(k);
    PyObject *evicted = PyList_New(0);
    if (out == NULL || evicted == NULL) goto fail;
    int32_t S = (int32_t)s->n;
    for (Py_ssize_t i = 0; i < k; i++) {
        int32_t b = s->next[S];
        unlink_block(s, b);
        s->ref[b] = 1;
        s->n_free--;
        PyObject *id = PyLong_FromLong(b);
        if (id == NULL) goto fail;
        PyList_SET_ITEM(out, i, id);
        PyObject *h = s->hash[b];
        if (h != NULL) { /* eviction: in the order handed out */
            PyObject *x = h64_of(h);
            int rc = x == NULL ? -1 : PyList_Append(evicted, x);
            Py_XDECREF(x);
            if (rc < 0 || map_remove(s, b, h) < 0) goto fail;
            s->hash[b] = NULL;
            Py_DECREF(h);
        }
    }
    return Py_BuildValue("(NN)", out, evicted);
fail:
    Py_XDECREF(out);
    Py_XDECREF(evicted);
    return NULL;
}

static PyObject *Pool_cache(Pool *s, PyObject *args) {
    PyObject *blocks, *hashes;
    if (!PyArg_ParseTuple(args, "OO", &blocks, &hashes)) return NULL;
    PyObject *bs = PySequence_Fast(blocks, "blocks must be a sequence");
    if (bs == NULL) return NULL;
    PyObject *hs = PySequence_Fast(hashes, "hashes must be a sequence");
    if (hs == NULL) {
        Py_DECREF(bs);
        return NULL;
    }
    Py_ssize_t m = PySequence_Fast_GET_SIZE(bs);
    PyObject *out = NULL;
    if (PySequence_Fast_GET_SIZE(hs) != m) {
        PyErr_SetString(PyExc_ValueError, "blocks and hashes differ in length");
        goto done;
    }
    out = PyList_New(m);
    if (out == NULL) goto done;
    PyObject **bi = PySequence_Fast_ITEMS(bs), **hi = PySequence_Fast_ITEMS(hs);
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t b;
        PyObject *h = hi[i];
        PyObject *x = h64_of(h);
        if (x == NULL || block_arg(s, bi[i], &b) < 0) {
            Py_XDECREF(x);
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, x);
        if (s->hash[b] == NULL) {
            if (map_add(s, b, h) < 0) {
                Py_CLEAR(out);
                goto done;
            }
            Py_INCREF(h);
            s->hash[b] = h;
        }
    }
done:
    Py_DECREF(bs);
    Py_DECREF(hs);
    return out;
}

/* Returns `blocks` in reverse order (a request's tail first); a block whose count reaches 0 joins the free queue:
 * a hashed one at the back (least recently used goes first), the unhashed ones at the front, in order. */
static PyObject *Pool_free_reversed(Pool *s, PyObject *blocks) {
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int32_t S = (int32_t)s->n, front = S;
    for (Py_ssize_t i = m - 1; i >= 0; i--) {
        int32_t b;
        if (block_arg(s, items[i], &b) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (s->ref[b] <= 0) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "block %d freed more often than referenced", b);
            return NULL;
        }
        if (--s->ref[b] == 0) {
            if (s->hash[b] != NULL) {
                insert_after(s, s->prev[S], b);
            } else {
                insert_after(s, front, b);
                front = b;
            }
            s->n_free++;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *Pool_free_queue(Pool *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(s->n_free);
    if (out == NULL) return NULL;
    int32_t S = (int32_t)s->n;
    Py_ssize_t i = 0;
    for (int32_t b = s->next[S]; b != S && i < s->n_free; b = s->next[b], i++) {
        PyObject *id = PyLong_FromLong(b);
        if (id == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, id);
    }
    return out;
}

/* How many blocks at the free queue's front, at most `limit`, hold no hash: handing them out evicts nothing. */
static PyObject *Pool_unhashed_front(Pool *s, PyObject *arg) {
    Py_ssize_t limit = PyLong_AsSsize_t(arg);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    int32_t S = (int32_t)s->n;
    Py_ssize_t i = 0;
    for (int32_t b = s->next[S]; b != S && i < limit && i < s->n_free && s->hash[b] == NULL; b = s->next[b]) i++;
    return PyLong_FromSsize_t(i);
}

static PyObject *Pool_ref_counts(Pool *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(s->n);
    for (Py_ssize_t i = 0; out != NULL && i < s->n; i++) {
        PyObject *x = PyLong_FromLong(s->ref[i]);
        if (x == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *Pool_hashes(Pool *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(s->n);
    for (Py_ssize_t i = 0; out != NULL && i < s->n; i++) {
        PyObject *h = s->hash[i] != NULL ? s->hash[i] : Py_None;
        Py_INCREF(h);
        PyList_SET_ITEM(out, i, h);
    }
    return out;
}

static PyObject *Pool_clear_hashes(Pool *s, PyObject *Py_UNUSED(ignored)) {
    for (Py_ssize_t i = 0; i < s->n; i++) Py_CLEAR(s->hash[i]);
    PyDict_Clear(s->cached);
    Py_RETURN_NONE;
}

static PyObject *Pool_get_n_free(Pool *s, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(s->n_free); }
static PyObject *Pool_get_cached(Pool *s, void *Py_UNUSED(closure)) {
    Py_INCREF(s->cached);
    return s->cached;
}
static PyObject *Pool_get_n(Pool *s, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(s->n); }

static PyMethodDef Pool_methods[] = {
    {"lookup", (PyCFunction)Pool_lookup, METH_VARARGS,
     "lookup(hashes, max_blocks) -> the blocks of the longest cached prefix of hashes[:max_blocks]"},
    {"num_evictable", (PyCFunction)Pool_num_evictable, METH_O, "how many of blocks are free (ref count 0)"},
    {"touch", (PyCFunction)Pool_touch, METH_O, "references each of blocks once more (free ones leave the queue)"},
    {"take", (PyCFunction)Pool_take, METH_O,
     "take(k) -> (the first k free blocks, referenced once; the 64-bit hashes they were evicted from, in order)"},
    {"cache", (PyCFunction)Pool_cache, METH_VARARGS,
     "cache(blocks, hashes) -> 64-bit hashes: each unhashed block takes its hash and joins the map"},
    {"free_reversed", (PyCFunction)Pool_free_reversed, METH_O, "drops one reference of each block, last first"},
    {"free_queue", (PyCFunction)Pool_free_queue, METH_NOARGS, "the free blocks, front (evicted first) first"},
    {"unhashed_front", (PyCFunction)Pool_unhashed_front, METH_O,
     "how many blocks at the free queue's front, at most limit, hold no hash (taking them evicts nothing)"},
    {"ref_counts", (PyCFunction)Pool_ref_counts, METH_NOARGS, "every block's ref count"},
    {"hashes", (PyCFunction)Pool_hashes, METH_NOARGS, "every block's hash (None: unhashed)"},
    {"clear_hashes", (PyCFunction)Pool_clear_hashes, METH_NOARGS, "forgets every hash (reset_prefix_cache)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"n_free", (getter)Pool_get_n_free, NULL, "free blocks", NULL},
    {"cached", (getter)Pool_get_cached, NULL, "hash -> block id or {block id: None}", NULL},
    {"num_blocks", (getter)Pool_get_n, NULL, "blocks, the null block included", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmd.engines.sim._blockpool.BlockPool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "vLLM's GPU block pool: ref counts, the LRU free queue, block hashes and the hash -> block map",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

/* ---- the CPU tier ---------------------------------------------------------------------------------------------- */

/* vLLM's CPU offload tier as an LRU set of block hashes: `cap` slots, each holding a hash (bytes), linked in LRU order
 * through `prev`/`next` (sentinel at index cap: next[cap] is the least recently used); an open-addressing table of
 * slot + 1 (0: empty, linear probing, backward-shift deletion) finds a hash's slot. ~32 bytes a block where an
 * OrderedDict costs ~90: 544 ranks' tiers of 39K blocks each. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t cap, len, hwm; /* slots, slots in use, slots ever used (the rest never touched) */
    PyObject **key;
    int32_t *prev, *next;
    int32_t *table;
    size_t mask;
    int32_t *spare; /* slots freed by eviction, reused first */
    Py_ssize_t n_spare;
    unsigned char *mark; /* store(): the job's hashes already in the tier, which eviction must pass over */
} Tier;

static inline size_t tier_home(Tier *t, PyObject *k, int *err) {
    Py_hash_t hv = PyObject_Hash(k);
    if (hv == -1) {
        *err = 1;
        return 0;
    }
    return (size_t)hv & t->mask;
}

/* The table index holding h's slot, or -1 if absent; -2 on error. */
static Py_ssize_t tier_find(Tier *t, PyObject *h) {
    int err = 0;
    size_t i = tier_home(t, h, &err);
    if (err) return -2;
    for (;;) {
        int32_t s = t->table[i];
        if (s == 0) return -1;
        PyObject *k = t->key[s - 1];
        if (k == h) return (Py_ssize_t)i;
        if (PyBytes_CheckExact(k) && PyBytes_CheckExact(h)) {
            if (PyBytes_GET_SIZE(k) == PyBytes_GET_SIZE(h) &&
                memcmp(PyBytes_AS_STRING(k), PyBytes_AS_STRING(h), (size_t)PyBytes_GET_SIZE(h)) == 0)
                return (Py_ssize_t)i;
        } else {
            int eq = PyObject_RichCompareBool(k, h, Py_EQ);
            if (eq < 0) return -2;
            if (eq) return (Py_ssize_t)i;
        }
        i = (i + 1) & t->mask;
    }
}

static inline void tier_link_back(Tier *t, int32_t s) { list_insert_after(t->prev, t->next, t->prev[t->cap], s); }
static inline void tier_unlink(Tier *t, int32_t s) { list_unlink(t->prev, t->next, s); }

/* Empties table index i (backward-shift deletion keeps every other entry reachable from its home). */
static int tier_table_delete(Tier *t, size_t i) {
    size_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        int32_t s = t->table[j];
        if (s == 0) break;
        int err = 0;
        size_t k = tier_home(t, t->key[s - 1], &err);
        if (err) return -1;
        /* the entry at j may move to i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            t->table[i] = s;
            i = j;
        }
    }
    t->table[i] = 0;
    return 0;
}

static int tier_insert(Tier *t, PyObject *h) {
    int32_t s = t->n_spare ? t->spare[--t->n_spare] : (int32_t)t->hwm++;
    int err = 0;
    size_t i = tier_home(t, h, &err);
    if (err) return -1;
    while (t->table[i] != 0) i = (i + 1) & t->mask;
    t->table[i] = s + 1;
    Py_INCREF(h);
    t->key[s] = h;
    tier_link_back(t, s);
    t->len++;
    return 0;
}

static void Tier_dealloc(Tier *t) {
    if (t->key != NULL) {
        for (Py_ssize_t i = 0; i < t->hwm; i++) Py_XDECREF(t->key[i]);
    }
    PyMem_Free(t->key);
    PyMem_Free(t->prev);
    PyMem_Free(t->next);
    PyMem_Free(t->table);
    PyMem_Free(t->spare);
    PyMem_Free(t->mark);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int Tier_init(Tier *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t cap;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &cap)) return -1;
    if (cap < 0 || cap > (INT32_MAX - 2) / 2) {
        PyErr_SetString(PyExc_ValueError, "capacity must be >= 0 and fit 30 bits");
        return -1;
    }
    if (t->key != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "CpuTier is already initialised");
        return -1;
    }
    size_t size = 8;
    while (size < 2 * (size_t)cap) size <<= 1;
    t->cap = cap;
    t->mask = size - 1;
    /* calloc: pages of slots never used stay untouched (a tier fills as the run goes) */
    t->key = PyMem_Calloc((size_t)cap + 1, sizeof(PyObject *));
    t->prev = PyMem_Calloc((size_t)cap + 1, sizeof(int32_t));
    t->next = PyMem_Calloc((size_t)cap + 1, sizeof(int32_t));
    t->table = PyMem_Calloc(size, sizeof(int32_t));
    t->spare = PyMem_Calloc((size_t)cap + 1, sizeof(int32_t));
    t->mark = PyMem_Calloc((size_t)cap + 1, 1);
    if (!t->key || !t->prev || !t->next || !t->table || !t->spare || !t->mark) {
        PyErr_NoMemory();
        return -1;
    }
    t->prev[cap] = t->next[cap] = (int32_t)cap;
    return 0;
}

static Py_ssize_t Tier_len(Tier *t) { return t->len; }

static int Tier_contains(Tier *t, PyObject *h) {
    Py_ssize_t i = tier_find(t, h);
    return i == -2 ? -1 : i >= 0;
}

static PyObject *Tier_run(Tier *t, PyObject *args) {
    PyObject *hashes;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "Onn", &hashes, &start, &stop)) return NULL;
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (stop > m) stop = m;
    if (start < 0) start = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t i = start;
    for (; i < stop; i++) {
        Py_ssize_t f = tier_find(t, items[i]);
        if (f == -2) {
            Py_DECREF(seq);
            return NULL;
        }
        if (f < 0) break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i > start ? i - start : 0);
}

static PyObject *Tier_touch(Tier *t, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t f = tier_find(t, items[i]);
        if (f == -2) {
            Py_DECREF(seq);
            return NULL;
        }
        if (f >= 0) {
            int32_t s = t->table[f] - 1;
            tier_unlink(t, s);
            tier_link_back(t, s);
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* One store job (the offloading connector's prepare_store + complete_store): hashes already in the tier are skipped
 * (and protected from eviction); LRU victims make room; a job that cannot make room (its new blocks exceed what the
 * tier holds besides its protected ones) is dropped, as vLLM's prepare_store returns None.
 * None: nothing stored. Else (kept, evicted): the job's indices stored (None: all of them), the victims' 64-bit
 * hashes in eviction order. */
static PyObject *Tier_store(Tier *t, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq), n_new = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *kept = NULL, *evicted = NULL, *result = NULL;
    int32_t S = (int32_t)t->cap;
    char *present = PyMem_Calloc((size_t)m + 1, 1);
    if (present == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t f = tier_find(t, items[i]);
        if (f == -2) goto done;
        if (f >= 0) {
            present[i] = 1;
            t->mark[t->table[f] - 1] = 1;
        } else {
            n_new++;
        }
    }
    Py_ssize_t n_evict = t->len + n_new - t->cap;
    if (n_new == 0 || (n_evict > 0 && n_new > t->cap)) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    if (n_evict > 0) {
        /* vLLM stores none of a job when its own held blocks leave too few others to evict */
        Py_ssize_t avail = 0;
        for (int32_t s = t->next[S]; avail < n_evict && s != S; s = t->next[s]) avail += !t->mark[s];
        if (avail < n_evict) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
    }
    evicted = PyList_New(0);
    if (evicted == NULL) goto done;
    for (int32_t s = t->next[S]; n_evict > 0 && s != S;) {
        int32_t nxt = t->next[s];
        if (!t->mark[s]) {
            PyObject *k = t->key[s];
            Py_ssize_t f = tier_find(t, k);
            PyObject *x = h64_of(k);
            if (f < 0 || x == NULL || PyList_Append(evicted, x) < 0 || tier_table_delete(t, (size_t)f) < 0) {
                Py_XDECREF(x);
                if (f == -1) PyErr_SetString(PyExc_RuntimeError, "CPU tier table lost a hash");
                goto done;
            }
            Py_DECREF(x);
            tier_unlink(t, s);
            t->key[s] = NULL;
            Py_DECREF(k);
            t->spare[t->n_spare++] = s;
            t->len--;
            n_evict--;
        }
        s = nxt;
    }
    if (n_new < m) {
        kept = PyList_New(0);
        if (kept == NULL) goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (present[i]) continue;
        if (kept != NULL) {
            PyObject *ix = PyLong_FromSsize_t(i);
            int rc = ix == NULL ? -1 : PyList_Append(kept, ix);
            Py_XDECREF(ix);
            if (rc < 0) goto done;
        }
        Py_ssize_t f = tier_find(t, items[i]);
        if (f == -2) goto done;
        if (f >= 0) continue; /* a hash twice in one job: stored once, where it first came */
        if (tier_insert(t, items[i]) < 0) goto done;
    }
    result = Py_BuildValue("(OO)", kept != NULL ? kept : Py_None, evicted);
done:
    if (present != NULL) {
        for (Py_ssize_t i = 0; i < m; i++) {
            if (!present[i]) continue;
            Py_ssize_t f = tier_find(t, items[i]);
            if (f >= 0) t->mark[t->table[f] - 1] = 0;
        }
        PyMem_Free(present);
    }
    Py_XDECREF(kept);
    Py_XDECREF(evicted);
    Py_DECREF(seq);
    return result;
}

static PyObject *Tier_keys(Tier *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(t->len);
    if (out == NULL) return NULL;
    int32_t S = (int32_t)t->cap;
    Py_ssize_t i = 0;
    for (int32_t s = t->next[S]; s != S && i < t->len; s = t->next[s], i++) {
        Py_INCREF(t->key[s]);
        PyList_SET_ITEM(out, i, t->key[s]);
    }
    return out;
}

static PyObject *Tier_get_capacity(Tier *t, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(t->cap); }

static PyMethodDef Tier_methods[] = {
    {"run", (PyCFunction)Tier_run, METH_VARARGS,
     "run(hashes, start, stop) -> how many of hashes[start:stop], from the first, the tier holds"},
    {"touch", (PyCFunction)Tier_touch, METH_O, "makes each held hash the most recently used, in order"},
    {"store", (PyCFunction)Tier_store, METH_O,
     "store(hashes) -> None (nothing stored) or (indices stored, None for all; evicted 64-bit hashes)"},
    {"keys", (PyCFunction)Tier_keys, METH_NOARGS, "the held hashes, least recently used first"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tier_getset[] = {
    {"capacity", (getter)Tier_get_capacity, NULL, "blocks the tier holds at most", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Tier_as_sequence = {
    .sq_length = (lenfunc)Tier_len,
    .sq_contains = (objobjproc)Tier_contains,
};

static PyTypeObject TierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmd.engines.sim._blockpool.CpuTier",
    .tp_basicsize = sizeof(Tier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "vLLM's CPU offload tier: an LRU set of block hashes of fixed capacity",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tier_init,
    .tp_dealloc = (destructor)Tier_dealloc,
    .tp_methods = Tier_methods,
    .tp_getset = Tier_getset,
    .tp_as_sequence = &Tier_as_sequence,
};

/* h64_tuple(hashes) -> each hash's 64-bit form as a tuple (llmd.kv.events.hash64 of each: bytes are converted, ints
 * kept). The simulator's agents convert every block their prompts add, ~1% of a 544-GPU run as a map over hash64. */
static PyObject *h64_tuple(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "hashes must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        PyObject *x = PyLong_CheckExact(h) ? Py_NewRef(h) : h64_of(h);
        if (x == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, x);
    }
    Py_DECREF(seq);
    return out;
}

static PyMethodDef module_methods[] = {
    {"h64_tuple", (PyCFunction)h64_tuple, METH_O, "each hash's 64-bit form (hash64), as a tuple"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "llmd.engines.sim._blockpool", "The simulated engine's GPU block pool and CPU tier in C.",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__blockpool(void) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&TierType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "BlockPool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&TierType);
    if (PyModule_AddObject(m, "CpuTier", (PyObject *)&TierType) < 0) {
        Py_DECREF(&TierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
