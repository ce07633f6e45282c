/* The simulated engine's GPU block pool and CPU tier in C: what block_pool.py's PyBlockPool and PyCpuTier do, with
 * the same results.
 *
 * Why: the pool's work is per block (a 195K-token context is ~3,000 blocks of 64 tokens, freed and re-referenced
 * every turn), and at 544 engine ranks Python's per-block loops were a quarter of the cluster simulator's time.
 *
 * State: ref counts, the free queue as vLLM's FreeKVCacheBlockQueue (a doubly linked list through `prev`/`next`,
 * sentinel at index n: next[n] is the front, evicted first), each block's hash (a bytes object or NULL), and the hash
 * -> block map: an open-addressing table of slots (the hash, 32 bits of its Python hash, the first block holding it,
 * which serves hits; linear probing, backward-shift deletion), and the other blocks holding one hash (rare) in
 * insertion order through `dup`. Python readers (P2P lookups, invariants) ask `in` or read `cached`, a dict made on
 * request.
 *
 * Why not a dict: a lookup in one reads its index, then its entry, then the block id's int object (three cache
 * misses a block, on 544 ranks' maps that no cache holds); a slot holds all the probe compares and answers, in one.
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
    struct Slot *table; /* the hash -> block map: 1.5n slots (at most n - 1 hashes), so never full */
    size_t size;
    int32_t *dup;       /* n entries: the next block holding the same hash as this one, 0 for none */
    PyObject **ids;     /* each block id's int, made when first handed out: requests' block lists share them */
} Pool;

/* A map slot, 16 bytes: empty while head is 0 (block 0 is the null block, never hashed). `key` is borrowed from
 * hash[head]; `hv` is 32 bits of its Python hash (slot_hash), which pick its home slot and are compared before the
 * key. */
typedef struct Slot {
    PyObject *key;
    uint32_t hv;
    int32_t head;
} Slot;

/* The home slot of hash hv in a table of `size` slots: the hash scaled to the size (no power-of-two size, so no
 * table twice as large as it needs to be). */
static inline size_t home_of(uint32_t hv, size_t size) { return (size_t)(((uint64_t)hv * (uint64_t)size) >> 32); }

/* A Python hash's 32 bits for the map, mixed (Fibonacci hashing): an int's hash is the int itself, and small ints
 * would all start at slot 0. */
static inline uint32_t slot_hash(Py_hash_t hv) { return (uint32_t)(((uint64_t)hv * 0x9E3779B97F4A7C15ull) >> 32); }

/* Block b's id as a Python int (a new reference), NULL on error. Kept, not made anew each time: an id goes into a
 * request's block list at every hit and allocation, and a shared one costs no allocation and no memory. */
static inline PyObject *block_id(Pool *s, int32_t b) {
    PyObject *o = s->ids[b];
    if (o == NULL) {
        o = PyLong_FromLong(b);
        if (o == NULL) return NULL;
        s->ids[b] = o;
    }
    Py_INCREF(o);
    return o;
}

/* ---- prefetching ------------------------------------------------------------------------------------------------ */

/* A pass over a request's blocks reads, for each, its hash object, then the map slot its hash picks: two dependent
 * cache misses a block (no rank's map stays in cache between its turns), paid one after the other. Asking for the
 * objects PF_AHEAD * 2 blocks ahead and for the slots PF_AHEAD ahead (the hash read from an object already on its
 * way) overlaps them. Only bytes objects are hashed early: nothing runs that the pass itself would not run. */
#define PF_AHEAD 8

/* Where a table (the pool's map, the CPU tier's) keeps the entry a hash starts its probe at. */
typedef const void *(*SlotOf)(const void *table, Py_hash_t hv);

static inline void prefetch_slot_of(const void *table, SlotOf slot_of, PyObject *h) {
    if (PyBytes_CheckExact(h)) {
        Py_hash_t hv = PyObject_Hash(h); /* a bytes object's hash: computed once, then read back */
        if (hv != -1) __builtin_prefetch(slot_of(table, hv));
        else PyErr_Clear(); /* (cannot fail for bytes; the lookup proper reports any error) */
    }
}

/* Before the pass over items[0:m]: the first objects and slots on their way. */
static inline void prefetch_start(const void *table, SlotOf slot_of, PyObject **items, Py_ssize_t m) {
    for (Py_ssize_t j = 0; j < m && j < 2 * PF_AHEAD; j++) __builtin_prefetch(items[j]);
    for (Py_ssize_t j = 0; j < m && j < PF_AHEAD; j++) prefetch_slot_of(table, slot_of, items[j]);
}

/* At block i of the pass: the object 2 * PF_AHEAD ahead and the slot PF_AHEAD ahead on their way. */
static inline void prefetch_step(const void *table, SlotOf slot_of, PyObject **items, Py_ssize_t i, Py_ssize_t m) {
    if (i + 2 * PF_AHEAD < m) __builtin_prefetch(items[i + 2 * PF_AHEAD]);
    if (i + PF_AHEAD < m) prefetch_slot_of(table, slot_of, items[i + PF_AHEAD]);
}

static const void *pool_slot(const void *pool, Py_hash_t hv) {
    const Pool *s = pool;
    return &s->table[home_of(slot_hash(hv), s->size)];
}

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

/* 1 if a (a key the map or the CPU tier holds) equals h, 0 if not, -1 with an error set: identity first (requests
 * share their contexts' hash objects), bytes by content, anything else as Python's == (a dict's semantics). */
static inline int key_eq(PyObject *a, PyObject *h) {
    if (a == h) return 1;
    if (PyBytes_CheckExact(a) && PyBytes_CheckExact(h))
        return PyBytes_GET_SIZE(a) == PyBytes_GET_SIZE(h) &&
               memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(h), (size_t)PyBytes_GET_SIZE(h)) == 0;
    return PyObject_RichCompareBool(a, h, Py_EQ);
}

/* The slot index holding h (whose hash is hv), or where it would go (an empty slot) with *found 0; -1 on error. */
static Py_ssize_t map_find(Pool *s, PyObject *h, uint32_t hv, int *found) {
    size_t i = home_of(hv, s->size);
    for (;;) {
        Slot *e = &s->table[i];
        if (e->head == 0) {
            *found = 0;
            return (Py_ssize_t)i;
        }
        if (e->hv == hv) {
            int eq = key_eq(e->key, h);
            if (eq < 0) return -1;
            if (eq) {
                *found = 1;
                return (Py_ssize_t)i;
            }
        }
        if (++i == s->size) i = 0;
    }
}

/* Empties slot i (backward-shift deletion keeps every other entry reachable from its home). */
static void map_delete_slot(Pool *s, size_t i) {
    size_t j = i;
    for (;;) {
        if (++j == s->size) j = 0;
        Slot *e = &s->table[j];
        if (e->head == 0) break;
        size_t k = home_of(e->hv, s->size);
        /* the entry at j may move to i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            s->table[i] = *e;
            i = j;
        }
    }
    s->table[i].head = 0;
    s->table[i].key = NULL;
}

/* map_find for h, its hash taken here (*hv: the slot's 32 bits of it). */
static inline Py_ssize_t map_find_key(Pool *s, PyObject *h, uint32_t *hv, int *found) {
    Py_hash_t full = PyObject_Hash(h);
    if (full == -1) return -1;
    *hv = slot_hash(full);
    return map_find(s, h, *hv, found);
}

/* Drops block b (holding hash h) from the map; nothing if it is not there. */
static int map_remove(Pool *s, int32_t b, PyObject *h) {
    uint32_t hv;
    int found;
    Py_ssize_t i = map_find_key(s, h, &hv, &found);
    if (i < 0) return -1;
    if (!found) return 0;
    Slot *e = &s->table[i];
    if (e->head == b) {
        int32_t nh = s->dup[b];
        s->dup[b] = 0;
        if (nh == 0) {
            map_delete_slot(s, (size_t)i);
        } else { /* the next block holding it serves hits now */
            e->head = nh;
            e->key = s->hash[nh];
        }
        return 0;
    }
    for (int32_t p = e->head; s->dup[p] != 0; p = s->dup[p]) {
        if (s->dup[p] == b) {
            s->dup[p] = s->dup[b];
            s->dup[b] = 0;
            break;
        }
    }
    return 0;
}

/* Adds block b under hash h (the caller makes hash[b] = h): the first block holding h serves hits, later ones queue
 * behind it in order. */
static int map_add(Pool *s, int32_t b, PyObject *h) {
    uint32_t hv;
    int found;
    Py_ssize_t i = map_find_key(s, h, &hv, &found);
    if (i < 0) return -1;
    Slot *e = &s->table[i];
    if (!found) {
        e->hv = hv;
        e->key = h;
        e->head = b;
        s->dup[b] = 0;
        return 0;
    }
    int32_t p = e->head;
    if (p == b) return 0;
    while (s->dup[p] != 0) {
        p = s->dup[p];
        if (p == b) return 0;
    }
    s->dup[p] = b;
    s->dup[b] = 0;
    return 0;
}

/* The block serving hits on h, 0 if none; -1 on error. */
static inline int32_t map_get(Pool *s, PyObject *h) {
    uint32_t hv;
    int found;
    Py_ssize_t i = map_find_key(s, h, &hv, &found);
    if (i < 0) return -1;
    return found ? s->table[i].head : 0;
}

/* ---- the type --------------------------------------------------------------------------------------------------- */

static void Pool_dealloc(Pool *s) {
    if (s->hash != NULL) {
        for (Py_ssize_t i = 0; i < s->n; i++) Py_XDECREF(s->hash[i]);
    }
    if (s->ids != NULL) {
        for (Py_ssize_t i = 0; i < s->n; i++) Py_XDECREF(s->ids[i]);
    }
    PyMem_Free(s->ids);
    PyMem_Free(s->hash);
    PyMem_Free(s->ref);
    PyMem_Free(s->prev);
    PyMem_Free(s->next);
    PyMem_Free(s->table);
    PyMem_Free(s->dup);
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
    s->size = (size_t)n + (size_t)n / 2 + 1;
    s->table = PyMem_Calloc(s->size, sizeof(Slot));
    s->dup = PyMem_Calloc((size_t)n, sizeof(int32_t));
    s->ids = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    if (!s->ref || !s->prev || !s->next || !s->hash || !s->table || !s->dup || !s->ids) {
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
    prefetch_start(s, pool_slot, items, m);
    for (Py_ssize_t i = 0; out != NULL && i < m; i++) {
        prefetch_step(s, pool_slot, items, i, m);
        int32_t b = map_get(s, items[i]);
        if (b <= 0) {
            if (b < 0) Py_CLEAR(out);
            break;
        }
        PyObject *id = block_id(s, b);
        if (id == NULL || PyList_Append(out, id) < 0) Py_CLEAR(out);
        Py_XDECREF(id);
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
        PyObject *id = block_id(s, b);
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
    prefetch_start(s, pool_slot, hi, m);
    for (Py_ssize_t i = 0; i < m; i++) {
        int32_t b;
        PyObject *h = hi[i];
        prefetch_step(s, pool_slot, hi, i, m);
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
    /* Tail first: each block's id object, then its ref count and links, asked for ahead (as prefetch_step). */
    for (Py_ssize_t j = m - 1; j >= 0 && j >= m - 2 * PF_AHEAD; j--) __builtin_prefetch(items[j]);
    for (Py_ssize_t i = m - 1; i >= 0; i--) {
        if (i >= 2 * PF_AHEAD) __builtin_prefetch(items[i - 2 * PF_AHEAD]);
        if (i >= PF_AHEAD && PyLong_CheckExact(items[i - PF_AHEAD])) {
            long a = PyLong_AsLong(items[i - PF_AHEAD]);
            if (a >= 1 && a < s->n) {
                __builtin_prefetch(&s->ref[a], 1);
                __builtin_prefetch(&s->prev[a], 1);
                __builtin_prefetch(&s->next[a], 1);
                __builtin_prefetch(&s->hash[a]);
            } else if (a == -1 && PyErr_Occurred()) {
                PyErr_Clear(); /* too large: block_arg reports it when the loop gets there */
            }
        }
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
    memset(s->table, 0, s->size * sizeof(Slot));
    memset(s->dup, 0, (size_t)s->n * sizeof(int32_t));
    Py_RETURN_NONE;
}

static PyObject *Pool_get_n_free(Pool *s, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(s->n_free); }
/* The map as a dict (hash -> block id, or {block id: None} in order when several blocks hold it): a copy, for readers
 * that want all of it (invariants, tests). */
static PyObject *Pool_get_cached(Pool *s, void *Py_UNUSED(closure)) {
    PyObject *out = PyDict_New();
    for (size_t i = 0; out != NULL && i < s->size; i++) {
        Slot *e = &s->table[i];
        if (e->head == 0) continue;
        PyObject *v;
        if (s->dup[e->head] == 0) {
            v = PyLong_FromLong(e->head);
        } else {
            v = PyDict_New();
            for (int32_t b = e->head; v != NULL && b != 0; b = s->dup[b]) {
                PyObject *k = PyLong_FromLong(b);
                if (k == NULL || PyDict_SetItem(v, k, Py_None) < 0) Py_CLEAR(v);
                Py_XDECREF(k);
            }
        }
        if (v == NULL || PyDict_SetItem(out, e->key, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

static int Pool_contains(Pool *s, PyObject *h) {
    int32_t b = map_get(s, h);
    return b < 0 ? -1 : b > 0;
}

static PySequenceMethods Pool_as_sequence = {.sq_contains = (objobjproc)Pool_contains};
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
    {"cached", (getter)Pool_get_cached, NULL, "a copy of the map: hash -> block id or {block id: None}", NULL},
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
    .tp_as_sequence = &Pool_as_sequence,
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

/* The table index holding h's slot, or -1 if absent (*empty: the free index where its probe ended, where an insert
 * puts it); -2 on error. */
static Py_ssize_t tier_probe(Tier *t, PyObject *h, size_t *empty) {
    int err = 0;
    size_t i = tier_home(t, h, &err);
    if (err) return -2;
    for (;;) {
        int32_t s = t->table[i];
        if (s == 0) {
            *empty = i;
            return -1;
        }
        int eq = key_eq(t->key[s - 1], h);
        if (eq < 0) return -2;
        if (eq) return (Py_ssize_t)i;
        i = (i + 1) & t->mask;
    }
}

/* The table index holding h's slot, or -1 if absent; -2 on error. */
static inline Py_ssize_t tier_find(Tier *t, PyObject *h) {
    size_t empty;
    return tier_probe(t, h, &empty);
}

static const void *tier_slot(const void *tier, Py_hash_t hv) {
    const Tier *t = tier;
    return &t->table[(size_t)hv & t->mask];
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

/* h into the tier at free table index i (where its probe ended: tier_probe's *empty), in a new slot at the LRU back. */
static void tier_insert_at(Tier *t, PyObject *h, size_t i) {
    int32_t s = t->n_spare ? t->spare[--t->n_spare] : (int32_t)t->hwm++;
    t->table[i] = s + 1;
    Py_INCREF(h);
    t->key[s] = h;
    tier_link_back(t, s);
    t->len++;
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
    /* Per hash of the job, the slot holding it already (marked: eviction passes over it), -1 for a new one. */
    int32_t *present = PyMem_Malloc(((size_t)m + 1) * sizeof(int32_t));
    if (present == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) present[i] = -1;
    prefetch_start(t, tier_slot, items, m);
    for (Py_ssize_t i = 0; i < m; i++) {
        prefetch_step(t, tier_slot, items, i, m);
        Py_ssize_t f = tier_find(t, items[i]);
        if (f == -2) goto done;
        if (f >= 0) {
            present[i] = t->table[f] - 1;
            t->mark[present[i]] = 1;
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
        if (present[i] >= 0) continue;
        if (kept != NULL) {
            PyObject *ix = PyLong_FromSsize_t(i);
            int rc = ix == NULL ? -1 : PyList_Append(kept, ix);
            Py_XDECREF(ix);
            if (rc < 0) goto done;
        }
        size_t at;
        Py_ssize_t f = tier_probe(t, items[i], &at);
        if (f == -2) goto done;
        if (f >= 0) continue; /* a hash twice in one job: stored once, where it first came */
        tier_insert_at(t, items[i], at);
    }
    result = Py_BuildValue("(OO)", kept != NULL ? kept : Py_None, evicted);
done:
    if (present != NULL) {
        for (Py_ssize_t i = 0; i < m; i++) {
            if (present[i] >= 0) t->mark[present[i]] = 0; /* eviction passed over it: still its slot */
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
