/* The KV index's storage and its event fast path, in C: see llmd/kv/index.py for what the index means.
 *
 * Entries (one per block hash) live in a slab of parallel arrays: key (8 B), interned holder-mask id (4 B) and the
 * recency list's prev/next (4 + 4 B). A linear-probing table of 4-byte slots finds them: entry index (27 bits), 2 tag
 * bits of the key's hash and the slot's distance from the key's home (3 bits, 7 meaning 7 or more), kept in Robin
 * Hood order (see probe()), so probes for new blocks end early and distances rarely saturate. Lookups compare keys
 * only where tag and distance both match; deletion shifts entries back by their distances alone, without reading
 * their keys (a random cache miss each). Table and slab go into huge pages once written (huge_hint()), and the
 * table grows a few slots per insertion (table_grow()): nothing on the caller's path stalls for a whole table.
 * Masks (which holder holds the block, in which tier: GPU bit 2*id, CPU bit 2*id+1) are interned:
 * a fleet has few distinct holder sets, so an entry holds an id, and a store or removal moves it to another id
 * through a small transition cache. About 27 bytes an entry at 20M entries, where a dict of Python ints costs ~120.
 *
 * `scan` reads one msgpack EventBatch payload straight into packed records (no Python object per event) and gives up
 * (returns None) on anything but the plain shapes vLLM sends; the msgspec decoder then decides. Token ids, most of
 * a payload's bytes, are skipped 16 bytes at a time where the CPU has SSSE3 or AVX2 (skip_ints_ssse3), one at a time
 * elsewhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define IDX_BITS 27
#define IDX_MASK ((1u << IDX_BITS) - 1)
#define TAG_OF(hk) ((uint32_t)((hk) >> 62) << IDX_BITS)
#define DIST_SHIFT (IDX_BITS + 2)
#define DIST_SAT 7u /* distances from 7 up are stored as 7: the key tells the rest */
#define DIST_OF(s) ((s) >> DIST_SHIFT)
#define TAG_FIELD (3u << IDX_BITS)
#define DIST_FIELD (DIST_SAT << DIST_SHIFT)
#define MAX_ENTRY_INDEX (IDX_MASK - 1)
#define TC_SIZE 4096
#define NONE32 0xFFFFFFFFu

static inline uint64_t mix64(uint64_t h) {
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    return h;
}

typedef struct {
    PyObject_HEAD
    /* entries; index 0 is the recency list's sentinel: nxt[0] the oldest, prv[0] the newest */
    uint64_t *key;
    uint32_t *msk, *prv, *nxt;
    uint32_t ecap, eused, efree, count;
    void *slab_map; /* the slab's reserved address space once it is large (slab_grow), else NULL: PyMem arrays */
    size_t slab_map_len;
    /* hash table; while it grows, `old` (osize slots) still holds the entries not yet moved (table_grow) */
    uint32_t *slots;
    uint32_t tsize;
    uint32_t *old;
    uint32_t osize, mig, mig_left; /* the next old slot to move, and how many old slots are left to pass */
    /* interned masks; id 0 is the empty mask */
    uint32_t nwords, mcap, mused, mlive, mgc_at;
    uint64_t *mw, *mh;
    uint32_t *mref;
    uint8_t *malive;
    uint32_t *mstack;
    uint32_t mstack_n;
    uint32_t *mtab;
    uint32_t mtsize;
    uint64_t *tc_key;
    uint32_t *tc_val;
    uint64_t *tmpw;
    /* policy and counters */
    long long max_entries, evict_batch, evictions, blocks_stored, blocks_removed;
    /* queries: holder objects by id, PrefixMatch, rank of each id in holder order */
    PyObject *holders, *pm_type;
    uint32_t *rank;
    uint32_t nrank;
} Core;

/* ---------------------------------------------------------------------------------------------------------------- */
/* masks                                                                                                            */

static uint64_t hash_words(const uint64_t *w, uint32_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL;
    for (uint32_t i = 0; i < n; i++) h = mix64(h ^ w[i]) + i;
    return h;
}

static int mtab_rebuild(Core *c, uint32_t size) {
    uint32_t *t = PyMem_Calloc(size, sizeof(uint32_t));
    if (!t) return -1;
    for (uint32_t id = 1; id < c->mused; id++) {
        if (!c->malive[id]) continue;
        uint32_t pos = (uint32_t)c->mh[id] & (size - 1);
        while (t[pos]) pos = (pos + 1) & (size - 1);
        t[pos] = id;
    }
    PyMem_Free(c->mtab);
    c->mtab = t;
    c->mtsize = size;
    return 0;
}

static void tc_clear(Core *c) { memset(c->tc_key, 0xFF, TC_SIZE * sizeof(uint64_t)); }

/* Forget masks no entry uses; their ids are reused, so the transition cache is dropped too. */
static int mask_gc(Core *c) {
    for (uint32_t id = 1; id < c->mused; id++) {
        if (c->malive[id] && c->mref[id] == 0) {
            c->malive[id] = 0;
            c->mstack[c->mstack_n++] = id;
            c->mlive--;
        }
    }
    tc_clear(c);
    if (mtab_rebuild(c, c->mtsize) < 0) return -1;
    c->mgc_at = c->mlive * 2 > 4096 ? c->mlive * 2 : 4096;
    return 0;
}

static int mask_grow(Core *c) {
    uint32_t cap = c->mcap * 2;
    uint64_t *mw = PyMem_Realloc(c->mw, (size_t)cap * c->nwords * sizeof(uint64_t));
    if (!mw) return -1;
    c->mw = mw;
    uint64_t *mh = PyMem_Realloc(c->mh, (size_t)cap * sizeof(uint64_t));
    if (!mh) return -1;
    c->mh = mh;
    uint32_t *mref = PyMem_Realloc(c->mref, (size_t)cap * sizeof(uint32_t));
    if (!mref) return -1;
    c->mref = mref;
    uint32_t *ms = PyMem_Realloc(c->mstack, (size_t)cap * sizeof(uint32_t));
    if (!ms) return -1;
    c->mstack = ms;
    uint8_t *ma = PyMem_Realloc(c->malive, cap);
    if (!ma) return -1;
    c->malive = ma;
    memset(c->malive + c->mcap, 0, cap - c->mcap);
    c->mcap = cap;
    return 0;
}

/* The id of the mask with these words (interned on first sight); NONE32 on memory error. */
static uint32_t intern(Core *c, const uint64_t *w) {
    uint32_t nw = c->nwords, i;
    for (i = 0; i < nw && !w[i]; i++) {
    }
    if (i == nw) return 0;
    uint64_t h = hash_words(w, nw);
    uint32_t m = c->mtsize - 1, pos = (uint32_t)h & m, id;
    while ((id = c->mtab[pos])) {
        if (c->mh[id] == h && !memcmp(c->mw + (size_t)id * nw, w, nw * sizeof(uint64_t))) return id;
        pos = (pos + 1) & m;
    }
    if (c->mstack_n) {
        id = c->mstack[--c->mstack_n];
    } else {
        if (c->mused == c->mcap && mask_grow(c) < 0) return NONE32;
        id = c->mused++;
    }
    memcpy(c->mw + (size_t)id * nw, w, nw * sizeof(uint64_t));
    c->mh[id] = h;
    c->mref[id] = 0;
    c->malive[id] = 1;
    c->mlive++;
    if (c->mlive * 2 > c->mtsize) {
        if (mtab_rebuild(c, c->mtsize * 2) < 0) return NONE32;
    } else {
        c->mtab[pos] = id;
    }
    return id;
}

static inline int mask_has(const Core *c, uint32_t id, uint32_t bit) {
    return (c->mw[(size_t)id * c->nwords + (bit >> 6)] >> (bit & 63)) & 1;
}

/* `from` with `bit` set (set=1) or cleared (set=0), through a direct-mapped cache of recent transitions. */
static uint32_t trans(Core *c, uint32_t from, uint32_t bit, int set) {
    uint64_t k = ((uint64_t)from << 32) | ((uint64_t)bit << 1) | (uint64_t)set;
    uint32_t i = (uint32_t)mix64(k) & (TC_SIZE - 1);
    if (c->tc_key[i] == k) return c->tc_val[i];
    uint32_t nw = c->nwords;
    memcpy(c->tmpw, c->mw + (size_t)from * nw, nw * sizeof(uint64_t));
    if (set)
        c->tmpw[bit >> 6] |= 1ULL << (bit & 63);
    else
        c->tmpw[bit >> 6] &= ~(1ULL << (bit & 63));
    uint32_t r = intern(c, c->tmpw);
    if (r != NONE32) {
        c->tc_key[i] = k;
        c->tc_val[i] = r;
    }
    return r;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* entries and the hash table                                                                                       */

/* Huge pages. The table and the slab are read at random, one cache miss per block or two; with 4 KB pages each such
 * read also misses the TLB, and a prefetch that misses the TLB arrives late or not at all (on the machines measured
 * it made random reads slower, where with 2 MB pages it made them faster), so the batch prefetching below would be
 * wasted. Transparent huge pages are asked for where the system leaves it to the program (the "madvise" setting). */
#define HUGE_PAGE ((size_t)2 << 20)
#define SLAB_MAP_AT (1u << 18) /* entries: from here on the slab lives in address space reserved for its largest size */

static inline size_t huge_round(size_t n) { return (n + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

/* The 2 MB-aligned part of [p, p + len) into huge pages: khugepaged collapses what is written already, in the
 * background. Only memory already written is hinted: with the common THP defrag setting (madvise) a first write to a
 * hinted page compacts memory for a whole huge page right there, 25-100 ms each on a busy machine, and a new table's
 * random writes touch all of its pages at once (0.9 s for a 64 MB table, seen at 6.3M entries). */
static void huge_hint(void *p, size_t len) {
#ifdef MADV_HUGEPAGE
    uintptr_t lo = huge_round((uintptr_t)p), hi = ((uintptr_t)p + len) & ~(HUGE_PAGE - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p;
    (void)len;
#endif
}

/* The table is Robin Hood ordered: along a run of occupied slots, entries lie in the order of their home slots. A probe
 * for an absent key then ends at the first entry closer to its home than the key would be, not at the end of the run
 * (about half the slots visited at the load factors the table runs at), an insertion goes in there (the rest of the
 * run shifts up a slot), and a deletion shifts entries back only until one sits at its home. Distances stay short, so
 * saturated ones (whose true value needs the key: a random cache miss) are rare. */

/* The true distance from its home of the entry in slot s at pos. */
static inline uint32_t slot_dist(const Core *c, uint32_t s, uint32_t pos, uint32_t m) {
    uint32_t d = DIST_OF(s);
    return d < DIST_SAT ? d : (pos - (uint32_t)mix64(c->key[s & IDX_MASK])) & m;
}

/* k's entry, or 0 with *at and *dist set to where it would go: the first empty slot, or the first entry whose home
 * comes after k's. compare = 0: k is known to be absent (table_grow), so no key is read but saturated ones. */
static inline uint32_t probe(const Core *c, const uint32_t *slots, uint32_t m, uint64_t k, int compare, uint32_t *at,
                             uint32_t *dist) {
    uint64_t hk = mix64(k);
    uint32_t pos = (uint32_t)hk & m, tag = TAG_OF(hk), d = 0, s;
    while ((s = slots[pos])) {
        uint32_t sd = DIST_OF(s);
        if (d < DIST_SAT) {
            if (sd < d) break;
            if (compare && sd == d && (s & TAG_FIELD) == tag && c->key[s & IDX_MASK] == k) return s & IDX_MASK;
        } else {
            if (sd < DIST_SAT) break;
            if (compare && (s & TAG_FIELD) == tag && c->key[s & IDX_MASK] == k) return s & IDX_MASK;
            if (slot_dist(c, s, pos, m) < d) break;
        }
        pos = (pos + 1) & m;
        d++;
    }
    *at = pos;
    *dist = d;
    return 0;
}

/* k's entry in the old table while the table grows (table_grow), else 0. */
static inline uint32_t find_old(const Core *c, uint64_t k) {
    uint32_t at, dist;
    return c->old ? probe(c, c->old, c->osize - 1, k, 1, &at, &dist) : 0;
}

static inline uint32_t find(const Core *c, uint64_t k) {
    uint32_t at, dist, e = probe(c, c->slots, c->tsize - 1, k, 1, &at, &dist);
    return e ? e : find_old(c, k);
}

static inline void prefetch_slot(const Core *c, uint64_t k) {
    __builtin_prefetch(&c->slots[(uint32_t)mix64(k) & (c->tsize - 1)]);
}

/* Entry e (tag bits `tag`) into slot pos at distance d: the entries from there to the end of the run move up one. */
static inline void insert_at(uint32_t *slots, uint32_t m, uint32_t pos, uint32_t d, uint32_t tag, uint32_t e) {
    uint32_t cur = ((d < DIST_SAT ? d : DIST_SAT) << DIST_SHIFT) | tag | e;
    for (;;) {
        uint32_t s = slots[pos];
        slots[pos] = cur;
        if (!s) return;
        cur = DIST_OF(s) < DIST_SAT ? s + (1u << DIST_SHIFT) : s;
        pos = (pos + 1) & m;
    }
}

/* Growth is incremental: a doubling of a table of millions of entries in one go stalled the router's event loop for
 * seconds (0.6 s at 3M entries, 2.1 s at 12.6M). The new table takes every new entry; each insertion then moves at
 * least MIGRATE_STEP slots of the old one, always on to the end of a run: a run moves whole, so a lookup in the old
 * table (every probe starts at its key's home and follows its run) sees the entries left there as they were, and
 * slots already moved are empty. Deletions in the old table shift entries back only within their run, never into
 * the moved part. The old table is done after osize / MIGRATE_STEP insertions at most, long before the new one is
 * due to grow (it starts at 3/8 full). */
#define MIGRATE_STEP 4u

static void migrate(Core *c, uint32_t n) {
    uint32_t om = c->osize - 1, m = c->tsize - 1;
    while (c->mig_left) {
        uint32_t s = c->old[c->mig];
        if (s) {
            uint32_t e = s & IDX_MASK, at, d;
            probe(c, c->slots, m, c->key[e], 0, &at, &d);
            insert_at(c->slots, m, at, d, s & TAG_FIELD, e);
            c->old[c->mig] = 0;
        } else if (!n) {
            break; /* at a run's end: the old table's runs from here on are whole */
        }
        c->mig = (c->mig + 1) & om;
        c->mig_left--;
        if (n) n--;
    }
    if (!c->mig_left) {
        PyMem_Free(c->old);
        c->old = NULL;
        c->osize = 0;
        huge_hint(c->slots, (size_t)c->tsize * sizeof(uint32_t)); /* written nearly everywhere by now (huge_hint) */
    }
}

static int table_grow(Core *c) {
    if (c->old) migrate(c, UINT32_MAX); /* not expected (see above), but a table grows from one old table at most */
    uint32_t size = c->tsize * 2;
    uint32_t *t = PyMem_Calloc(size, sizeof(uint32_t));
    if (!t) return -1;
    uint32_t start = 0; /* moving starts at an empty slot: from there on every run is whole (load <= 3/4: one exists) */
    while (c->slots[start]) start++;
    c->old = c->slots;
    c->osize = c->tsize;
    c->mig = start;
    c->mig_left = c->tsize;
    c->slots = t;
    c->tsize = size;
    return 0;
}

/* Take entry e out of a table if it is there (its run, from its home, holds it): the entries after it move back a
 * slot, up to an empty slot or one at its home. */
static int table_del_in(Core *c, uint32_t *slots, uint32_t size, uint32_t e) {
    uint32_t m = size - 1, i = (uint32_t)mix64(c->key[e]) & m, s;
    while ((s = slots[i]) && (s & IDX_MASK) != e) i = (i + 1) & m;
    if (!s) return 0;
    for (;;) {
        uint32_t j = (i + 1) & m;
        s = slots[j];
        if (!s || !DIST_OF(s)) break;
        uint32_t d = slot_dist(c, s, j, m) - 1;
        slots[i] = (s & ~DIST_FIELD) | ((d < DIST_SAT ? d : DIST_SAT) << DIST_SHIFT);
        i = j;
    }
    slots[i] = 0;
    return 1;
}

static void table_del(Core *c, uint32_t e) {
    if (!table_del_in(c, c->slots, c->tsize, e) && c->old) table_del_in(c, c->old, c->osize, e);
}

static inline void lru_unlink(Core *c, uint32_t e) {
    uint32_t p = c->prv[e], n = c->nxt[e];
    c->nxt[p] = n;
    c->prv[n] = p;
}

static inline void lru_append(Core *c, uint32_t e) {
    uint32_t p = c->prv[0];
    c->nxt[p] = e;
    c->prv[e] = p;
    c->nxt[e] = 0;
    c->prv[0] = e;
}

/* Move the slab into one reservation of address space for 2**27 entries: pages are only taken as entries are first
 * written (MAP_NORESERVE), so memory stays what realloc would hold, and the slab never moves or grows again
 * (realloc's moves split huge pages back into small ones). What is written goes into huge pages as it fills
 * (slab_hint). 0, or -1 where the reservation is refused (an address-space limit): the slab then stays on PyMem. */
static int slab_map(Core *c) {
    size_t cap = (size_t)MAX_ENTRY_INDEX + 1, lk = huge_round(cap * 8), l4 = huge_round(cap * 4);
    size_t len = lk + 3 * l4 + HUGE_PAGE;
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return -1;
    uint8_t *base = (uint8_t *)huge_round((uintptr_t)p);
    uint64_t *key = (uint64_t *)base;
    uint32_t *msk = (uint32_t *)(base + lk), *prv = (uint32_t *)(base + lk + l4);
    uint32_t *nxt = (uint32_t *)(base + lk + 2 * l4);
    memcpy(key, c->key, (size_t)c->eused * sizeof(uint64_t));
    memcpy(msk, c->msk, (size_t)c->eused * sizeof(uint32_t));
    memcpy(prv, c->prv, (size_t)c->eused * sizeof(uint32_t));
    memcpy(nxt, c->nxt, (size_t)c->eused * sizeof(uint32_t));
    PyMem_Free(c->key);
    PyMem_Free(c->msk);
    PyMem_Free(c->prv);
    PyMem_Free(c->nxt);
    c->key = key;
    c->msk = msk;
    c->prv = prv;
    c->nxt = nxt;
    c->ecap = (uint32_t)cap;
    c->slab_map = p;
    c->slab_map_len = len;
    return 0;
}

/* The slab's first n entries, written, into huge pages (huge_hint): every SLAB_HINT_EVERY new entries, 2 MB of keys. */
#define SLAB_HINT_EVERY (1u << 18)
static void slab_hint(Core *c, uint32_t n) {
    huge_hint(c->key, (size_t)n * sizeof(uint64_t));
    huge_hint(c->msk, (size_t)n * sizeof(uint32_t));
    huge_hint(c->prv, (size_t)n * sizeof(uint32_t));
    huge_hint(c->nxt, (size_t)n * sizeof(uint32_t));
}

static int slab_grow(Core *c) {
    uint32_t cap = c->ecap * 2;
    if (!c->slab_map && cap >= SLAB_MAP_AT && slab_map(c) == 0) return 0;
    if (cap > MAX_ENTRY_INDEX + 1) cap = MAX_ENTRY_INDEX + 1;
    if (cap <= c->ecap) {
        PyErr_SetString(PyExc_MemoryError, "KV index: more than 2**27 entries");
        return -1;
    }
    uint64_t *key = PyMem_Realloc(c->key, (size_t)cap * sizeof(uint64_t));
    if (!key) goto fail;
    c->key = key;
    uint32_t *a = PyMem_Realloc(c->msk, (size_t)cap * sizeof(uint32_t));
    if (!a) goto fail;
    c->msk = a;
    a = PyMem_Realloc(c->prv, (size_t)cap * sizeof(uint32_t));
    if (!a) goto fail;
    c->prv = a;
    a = PyMem_Realloc(c->nxt, (size_t)cap * sizeof(uint32_t));
    if (!a) goto fail;
    c->nxt = a;
    c->ecap = cap;
    return 0;
fail:
    PyErr_NoMemory();
    return -1;
}

/* Forget entry e entirely (its mask reference already dropped). */
static void entry_free(Core *c, uint32_t e) {
    table_del(c, e);
    lru_unlink(c, e);
    c->msk[e] = 0;
    c->nxt[e] = c->efree;
    c->efree = e;
    c->count--;
}

/* Store one block for `bit`: known blocks gain the bit and become the most recent; new ones are appended. */
static int store_one(Core *c, uint64_t k, uint32_t bit) {
    uint32_t at = 0, dist = 0, e = probe(c, c->slots, c->tsize - 1, k, 1, &at, &dist);
    if (!e) e = find_old(c, k); /* at and dist stay where a new entry goes: the new table */
    if (e) {
        uint32_t old = c->msk[e];
        if (!mask_has(c, old, bit)) {
            uint32_t nm = trans(c, old, bit, 1);
            if (nm == NONE32) return -1;
            c->mref[old]--;
            c->mref[nm]++;
            c->msk[e] = nm;
        }
        if (c->prv[0] != e) {
            lru_unlink(c, e);
            lru_append(c, e);
        }
        return 0;
    }
    if (c->efree) {
        e = c->efree;
        c->efree = c->nxt[e];
    } else {
        if (c->eused == c->ecap && slab_grow(c) < 0) return -1;
        e = c->eused++;
        if (c->slab_map && !(e & (SLAB_HINT_EVERY - 1))) slab_hint(c, e);
    }
    if ((c->count + 1) * 4ULL > c->tsize * 3ULL) {
        if (table_grow(c) < 0) {
            c->nxt[e] = c->efree;
            c->efree = e;
            PyErr_NoMemory();
            return -1;
        }
        probe(c, c->slots, c->tsize - 1, k, 0, &at, &dist);
    }
    uint32_t nm = trans(c, 0, bit, 1);
    if (nm == NONE32) {
        c->nxt[e] = c->efree;
        c->efree = e;
        PyErr_NoMemory();
        return -1;
    }
    c->key[e] = k;
    c->msk[e] = nm;
    c->mref[nm]++;
    insert_at(c->slots, c->tsize - 1, at, dist, TAG_OF(mix64(k)), e);
    lru_append(c, e);
    c->count++;
    if (c->old) migrate(c, MIGRATE_STEP);
    return 0;
}

/* 1 if the block lost `bit`, 0 if it did not have it; -1 on memory error. Removal doesn't refresh recency. */
static int remove_one(Core *c, uint64_t k, uint32_t bit) {
    uint32_t e = find(c, k);
    if (!e) return 0;
    uint32_t old = c->msk[e];
    if (!mask_has(c, old, bit)) return 0;
    uint32_t nm = trans(c, old, bit, 0);
    if (nm == NONE32) {
        PyErr_NoMemory();
        return -1;
    }
    c->mref[old]--;
    if (nm == 0) {
        entry_free(c, e);
    } else {
        c->mref[nm]++;
        c->msk[e] = nm;
    }
    return 1;
}

/* The cap: beyond max_entries, drop the least recently stored entries (every holder, both tiers), evict_batch more.
 * Victims go in chunks, each in stages that first touch (prefetch) what the next stage reads (the victims' keys, then
 * their table slots), so the cache misses of a chunk's victims overlap instead of following one another. */
#define EVICT_CHUNK 64

static void evict(Core *c) {
    if ((long long)c->count <= c->max_entries) return;
    long long k = (long long)c->count - c->max_entries + c->evict_batch;
    if (k > (long long)c->count) k = c->count;
    uint32_t vic[EVICT_CHUNK];
    uint32_t m = c->tsize - 1;
    for (long long done = 0; done < k;) {
        int nv = k - done < EVICT_CHUNK ? (int)(k - done) : EVICT_CHUNK;
        uint32_t e = c->nxt[0];
        for (int j = 0; j < nv; j++) {
            vic[j] = e;
            __builtin_prefetch(&c->key[e]);
            e = c->nxt[e];
        }
        for (int j = 0; j < nv; j++) __builtin_prefetch(&c->slots[(uint32_t)mix64(c->key[vic[j]]) & m]);
        for (int j = 0; j < nv; j++) {
            c->mref[c->msk[vic[j]]]--;
            entry_free(c, vic[j]);
        }
        done += nv;
    }
    c->evictions += k;
}

static int maybe_gc(Core *c) { return c->mlive > c->mgc_at ? mask_gc(c) : 0; }

/* ---------------------------------------------------------------------------------------------------------------- */
/* Python type                                                                                                      */

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"max_entries", "evict_batch", "holders", "prefix_match", NULL};
    long long max_entries, evict_batch;
    PyObject *holders, *pm;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLO!O", kwlist, &max_entries, &evict_batch, &PyList_Type, &holders,
                                     &pm))
        return -1;
    if (c->key) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once");
        return -1;
    }
    c->max_entries = max_entries;
    c->evict_batch = evict_batch;
    Py_INCREF(holders);
    c->holders = holders;
    Py_INCREF(pm);
    c->pm_type = pm;
    c->ecap = 1024;
    c->key = PyMem_Malloc(c->ecap * sizeof(uint64_t));
    c->msk = PyMem_Calloc(c->ecap, sizeof(uint32_t));
    c->prv = PyMem_Calloc(c->ecap, sizeof(uint32_t));
    c->nxt = PyMem_Calloc(c->ecap, sizeof(uint32_t));
    c->eused = 1;
    c->tsize = 1024;
    c->slots = PyMem_Calloc(c->tsize, sizeof(uint32_t));
    c->nwords = 1;
    c->mcap = 64;
    c->mused = 1;
    c->mw = PyMem_Calloc(c->mcap * c->nwords, sizeof(uint64_t));
    c->mh = PyMem_Calloc(c->mcap, sizeof(uint64_t));
    c->mref = PyMem_Calloc(c->mcap, sizeof(uint32_t));
    c->malive = PyMem_Calloc(c->mcap, 1);
    c->mstack = PyMem_Calloc(c->mcap, sizeof(uint32_t));
    c->mtsize = 256;
    c->mtab = PyMem_Calloc(c->mtsize, sizeof(uint32_t));
    c->mgc_at = 4096;
    c->tc_key = PyMem_Malloc(TC_SIZE * sizeof(uint64_t));
    c->tc_val = PyMem_Calloc(TC_SIZE, sizeof(uint32_t));
    c->tmpw = PyMem_Calloc(c->nwords, sizeof(uint64_t));
    if (!c->key || !c->msk || !c->prv || !c->nxt || !c->slots || !c->mw || !c->mh || !c->mref || !c->malive ||
        !c->mstack || !c->mtab || !c->tc_key || !c->tc_val || !c->tmpw) {
        PyErr_NoMemory();
        return -1;
    }
    c->malive[0] = 1;
    tc_clear(c);
    return 0;
}

static void Core_dealloc(Core *c) {
    if (c->slab_map) {
        munmap(c->slab_map, c->slab_map_len);
    } else {
        PyMem_Free(c->key);
        PyMem_Free(c->msk);
        PyMem_Free(c->prv);
        PyMem_Free(c->nxt);
    }
    PyMem_Free(c->slots);
    PyMem_Free(c->old);
    PyMem_Free(c->mw);
    PyMem_Free(c->mh);
    PyMem_Free(c->mref);
    PyMem_Free(c->malive);
    PyMem_Free(c->mstack);
    PyMem_Free(c->mtab);
    PyMem_Free(c->tc_key);
    PyMem_Free(c->tc_val);
    PyMem_Free(c->tmpw);
    PyMem_Free(c->rank);
    Py_XDECREF(c->holders);
    Py_XDECREF(c->pm_type);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* Room for holder ids < n: masks widen to 2n bits. */
static PyObject *Core_ensure_holders(Core *c, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n < 0 && PyErr_Occurred()) return NULL;
    uint32_t nw = (uint32_t)((2 * n + 63) / 64);
    if (nw <= c->nwords) Py_RETURN_NONE;
    uint64_t *mw = PyMem_Calloc((size_t)c->mcap * nw, sizeof(uint64_t));
    uint64_t *tmp = PyMem_Calloc(nw, sizeof(uint64_t));
    if (!mw || !tmp) {
        PyMem_Free(mw);
        PyMem_Free(tmp);
        return PyErr_NoMemory();
    }
    for (uint32_t id = 0; id < c->mused; id++)
        memcpy(mw + (size_t)id * nw, c->mw + (size_t)id * c->nwords, c->nwords * sizeof(uint64_t));
    PyMem_Free(c->mw);
    PyMem_Free(c->tmpw);
    c->mw = mw;
    c->tmpw = tmp;
    c->nwords = nw;
    for (uint32_t id = 1; id < c->mused; id++)
        if (c->malive[id]) c->mh[id] = hash_words(c->mw + (size_t)id * nw, nw);
    if (mtab_rebuild(c, c->mtsize) < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

#define PREFETCH_AHEAD 8

/* Fill `out` with the 64-bit forms of a sequence of ints; returns its length or -1. */
static Py_ssize_t read_keys(PyObject *seq, uint64_t **out) {
    PyObject *fast = PySequence_Fast(seq, "block hashes must be a sequence of ints");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t *keys = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
    if (!keys) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    /* Each key is an int object of its own, read once: ask for them ahead (a tuple of a request's keys is thousands
     * of objects, made when their turns were, so not all in cache). */
    for (Py_ssize_t i = 0; i < n && i < 2 * PREFETCH_AHEAD; i++) __builtin_prefetch(items[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + 2 * PREFETCH_AHEAD < n) __builtin_prefetch(items[i + 2 * PREFETCH_AHEAD]);
        uint64_t v = PyLong_AsUnsignedLongLongMask(items[i]);
        if (v == (uint64_t)-1 && PyErr_Occurred()) {
            PyMem_Free(keys);
            Py_DECREF(fast);
            return -1;
        }
        keys[i] = v;
    }
    Py_DECREF(fast);
    *out = keys;
    return n;
}

static int store_keys(Core *c, const uint64_t *keys, Py_ssize_t n, uint32_t bit) {
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_slot(c, keys[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_slot(c, keys[i + PREFETCH_AHEAD]);
        if (store_one(c, keys[i], bit) < 0) return -1;
    }
    c->blocks_stored += n;
    return 0;
}

static long long remove_keys(Core *c, const uint64_t *keys, Py_ssize_t n, uint32_t bit) {
    long long removed = 0;
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_slot(c, keys[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_slot(c, keys[i + PREFETCH_AHEAD]);
        int r = remove_one(c, keys[i], bit);
        if (r < 0) return -1;
        removed += r;
    }
    c->blocks_removed += removed;
    return removed;
}

/* store(hashes, bit): one run of blocks into one holder's tier; no eviction (see evict()). */
static PyObject *Core_store(Core *c, PyObject *args) {
    PyObject *seq;
    unsigned int bit;
    if (!PyArg_ParseTuple(args, "OI", &seq, &bit)) return NULL;
    if (maybe_gc(c) < 0) return PyErr_NoMemory();
    uint64_t *keys;
    Py_ssize_t n = read_keys(seq, &keys);
    if (n < 0) return NULL;
    int r = store_keys(c, keys, n, bit);
    PyMem_Free(keys);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_remove(Core *c, PyObject *args) {
    PyObject *seq;
    unsigned int bit;
    if (!PyArg_ParseTuple(args, "OI", &seq, &bit)) return NULL;
    if (maybe_gc(c) < 0) return PyErr_NoMemory();
    uint64_t *keys;
    Py_ssize_t n = read_keys(seq, &keys);
    if (n < 0) return NULL;
    long long r = remove_keys(c, keys, n, bit);
    PyMem_Free(keys);
    if (r < 0) return NULL;
    return PyLong_FromLongLong(r);
}

static PyObject *Core_evict(Core *c, PyObject *Py_UNUSED(ignored)) {
    evict(c);
    Py_RETURN_NONE;
}

/* Records from `scan`: u64 header (kind | gpu << 8 | array form << 9 | n << 32), u64 span (start | end << 32), then
 * n hashes. apply_records(records, offset, gpu_bit): applies from `offset` up to and including the next
 * AllBlocksCleared; returns the offset after it (the caller clears the holder and goes on with its new bits) or -1
 * at the end. */
#define REC_STORED 0
#define REC_REMOVED 1
#define REC_CLEARED 2

static PyObject *Core_apply_records(Core *c, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t off;
    unsigned int gbit;
    if (!PyArg_ParseTuple(args, "y*nI", &buf, &off, &gbit)) return NULL;
    if (maybe_gc(c) < 0) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    const uint64_t *w = (const uint64_t *)buf.buf;
    Py_ssize_t nw = buf.len / 8, i = off / 8;
    /* warm the table slots of every hash up to the next clear: the probes below then mostly hit the cache */
    for (Py_ssize_t j = i; j < nw;) {
        uint64_t hd = w[j];
        uint32_t n = (uint32_t)(hd >> 32);
        if ((hd & 0xFF) == REC_CLEARED) break;
        for (uint32_t t = 0; t < n; t++) prefetch_slot(c, w[j + 2 + t]);
        j += 2 + n;
    }
    Py_ssize_t next = -1;
    while (i < nw) {
        uint64_t hd = w[i];
        uint32_t kind = hd & 0xFF, n = (uint32_t)(hd >> 32);
        uint32_t bit = (hd >> 8) & 1 ? gbit : gbit + 1;
        const uint64_t *keys = w + i + 2;
        i += 2 + n;
        if (kind == REC_STORED) {
            for (uint32_t t = 0; t < n; t++) {
                if (store_one(c, keys[t], bit) < 0) {
                    PyBuffer_Release(&buf);
                    return NULL;
                }
            }
            c->blocks_stored += n;
        } else if (kind == REC_REMOVED) {
            long long r = 0;
            for (uint32_t t = 0; t < n; t++) {
                int x = remove_one(c, keys[t], bit);
                if (x < 0) {
                    PyBuffer_Release(&buf);
                    return NULL;
                }
                r += x;
            }
            c->blocks_removed += r;
        } else {
            next = i * 8;
            break;
        }
    }
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(next);
}

/* clear(ids): forget every block of these holder ids, both tiers; returns how many entries held any of them. */
static PyObject *Core_clear(Core *c, PyObject *arg) {
    uint64_t *ids;
    Py_ssize_t nid = read_keys(arg, &ids);
    if (nid < 0) return NULL;
    uint32_t nw = c->nwords;
    uint64_t *clr = PyMem_Calloc(nw, sizeof(uint64_t));
    uint32_t *map = PyMem_Malloc((size_t)c->mused * sizeof(uint32_t));
    if (!clr || !map) {
        PyMem_Free(ids);
        PyMem_Free(clr);
        PyMem_Free(map);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nid; i++) {
        uint64_t b = ids[i] * 2;
        if (b / 64 < nw) clr[b / 64] |= 3ULL << (b & 63);
    }
    PyMem_Free(ids);
    for (uint32_t id = 0; id < c->mused; id++) map[id] = NONE32;
    map[0] = 0;
    uint32_t mused = c->mused; /* masks interned below get ids >= mused: never an entry's before this pass */
    long long touched = 0;
    for (uint32_t e = 1; e < c->eused; e++) {
        uint32_t m = c->msk[e];
        if (!m) continue;
        uint32_t nm = map[m];
        if (nm == NONE32) {
            const uint64_t *src = c->mw + (size_t)m * nw;
            int hit = 0;
            for (uint32_t k = 0; k < nw; k++) {
                c->tmpw[k] = src[k] & ~clr[k];
                hit |= (src[k] & clr[k]) != 0;
            }
            nm = hit ? intern(c, c->tmpw) : m;
            if (nm == NONE32) {
                PyMem_Free(clr);
                PyMem_Free(map);
                return PyErr_NoMemory();
            }
            map[m] = nm;
        }
        if (nm == m) continue;
        touched++;
        c->mref[m]--;
        if (nm == 0) {
            entry_free(c, e);
        } else {
            c->mref[nm]++;
            c->msk[e] = nm;
        }
    }
    (void)mused;
    PyMem_Free(clr);
    PyMem_Free(map);
    if (mask_gc(c) < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(touched);
}

/* set_order(ids): holder ids in holder order, the tie-break of query answers. */
static PyObject *Core_set_order(Core *c, PyObject *arg) {
    uint64_t *ids;
    Py_ssize_t n = read_keys(arg, &ids);
    if (n < 0) return NULL;
    uint32_t size = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (ids[i] + 1 > size) size = (uint32_t)ids[i] + 1;
    uint32_t *rank = PyMem_Malloc((size ? size : 1) * sizeof(uint32_t));
    if (!rank) {
        PyMem_Free(ids);
        return PyErr_NoMemory();
    }
    for (uint32_t i = 0; i < size; i++) rank[i] = NONE32;
    for (Py_ssize_t i = 0; i < n; i++) rank[ids[i]] = (uint32_t)i;
    PyMem_Free(ids);
    PyMem_Free(c->rank);
    c->rank = rank;
    c->nrank = size;
    Py_RETURN_NONE;
}

typedef struct {
    uint32_t hid, any, gpu, prefix, start, rank;
    int32_t gstart; /* start of the current GPU run, -1 outside one */
} Match;

static int match_cmp(const void *a, const void *b) {
    const Match *x = a, *y = b;
    if (x->any != y->any) return x->any > y->any ? -1 : 1;
    if (x->gpu != y->gpu) return x->gpu > y->gpu ? -1 : 1;
    return x->rank < y->rank ? -1 : x->rank > y->rank;
}

/* One block's (restricted) mask differs from the previous one: holders leave, enter or leave GPU runs at i. */
static uint32_t walk_change(const Core *c, Match *alive, uint32_t nalive, Match *done, uint32_t *ndone, uint32_t mid,
                            uint32_t i) {
    const uint64_t *w = c->mw + (size_t)mid * c->nwords;
    uint32_t k = 0;
    for (uint32_t a = 0; a < nalive; a++) {
        Match m = alive[a];
        uint32_t b = m.hid * 2;
        int g = (w[b >> 6] >> (b & 63)) & 1, cp = (w[b >> 6] >> ((b + 1) & 63)) & 1;
        if (m.gstart >= 0 && !g) {
            m.gpu += i - (uint32_t)m.gstart;
            m.gstart = -1;
            if (m.prefix == NONE32) m.prefix = i;
        } else if (m.gstart < 0 && g) {
            m.gstart = (int32_t)i;
        }
        if (!g && !cp) {
            m.any = i;
            done[(*ndone)++] = m;
        } else {
            alive[k++] = m;
        }
    }
    return k;
}

/* The walk behind both query forms: every holder of the first block, its consecutive cached prefix, unsorted, in
 * *out (PyMem; NULL with *nout 0 when nobody holds the first block). Probes run PREFETCH_AHEAD blocks ahead of the
 * walk, so cache misses overlap. -1 on error (exception set). */
static int walk(Core *c, PyObject *arg, Match **out, uint32_t *nout) {
    uint64_t *keys;
    *out = NULL;
    *nout = 0;
    Py_ssize_t n = read_keys(arg, &keys);
    if (n < 0) return -1;
    uint32_t e0 = n && c->count ? find(c, keys[0]) : 0;
    if (!e0) {
        PyMem_Free(keys);
        return 0;
    }
    uint32_t nw = c->nwords, nh = nw * 32;
    Match *alive = PyMem_Malloc(nh * sizeof(Match)), *done = PyMem_Malloc(nh * sizeof(Match));
    uint64_t *restr = PyMem_Malloc(nw * sizeof(uint64_t)), *aliveset = PyMem_Calloc(nw, sizeof(uint64_t));
    if (!alive || !done || !restr || !aliveset) {
        PyMem_Free(keys);
        PyMem_Free(alive);
        PyMem_Free(done);
        PyMem_Free(restr);
        PyMem_Free(aliveset);
        PyErr_NoMemory();
        return -1;
    }
    uint32_t nalive = 0, ndone = 0, m0 = c->msk[e0];
    const uint64_t *w0 = c->mw + (size_t)m0 * nw;
    for (uint32_t h = 0; h < nh; h++) {
        uint32_t b = h * 2;
        uint64_t two = (w0[b >> 6] >> (b & 63)) & 3;
        if (!two) continue;
        Match m = {h, 0, 0, NONE32, 0, 0, (two & 1) ? 0 : -1};
        if (!(two & 1)) m.prefix = 0;
        alive[nalive++] = m;
        aliveset[b >> 6] |= 3ULL << (b & 63);
    }
    for (uint32_t k = 0; k < nw; k++) restr[k] = w0[k];
    uint32_t prev = m0;
    Py_ssize_t i;
    for (i = 1; i < n && i <= PREFETCH_AHEAD; i++) prefetch_slot(c, keys[i]);
    for (i = 1; i < n && nalive; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_slot(c, keys[i + PREFETCH_AHEAD]);
        uint32_t e = find(c, keys[i]);
        uint32_t mid = e ? c->msk[e] : 0;
        if (mid == prev) continue;
        /* a different mask: does it differ for the holders still in the walk? */
        const uint64_t *w = c->mw + (size_t)mid * nw;
        int same = 1;
        for (uint32_t k = 0; k < nw; k++) {
            if ((w[k] & aliveset[k]) != restr[k]) {
                same = 0;
                break;
            }
        }
        prev = mid;
        if (same) continue;
        nalive = walk_change(c, alive, nalive, done, &ndone, mid, (uint32_t)i);
        memset(aliveset, 0, nw * sizeof(uint64_t));
        for (uint32_t a = 0; a < nalive; a++) {
            uint32_t b = alive[a].hid * 2;
            aliveset[b >> 6] |= 3ULL << (b & 63);
        }
        for (uint32_t k = 0; k < nw; k++) restr[k] = w[k] & aliveset[k];
    }
    for (uint32_t a = 0; a < nalive; a++) {
        Match m = alive[a];
        if (m.gstart >= 0) m.gpu += (uint32_t)n - (uint32_t)m.gstart;
        if (m.prefix == NONE32) m.prefix = (uint32_t)n;
        m.any = (uint32_t)n;
        done[ndone++] = m;
    }
    PyMem_Free(keys);
    PyMem_Free(alive);
    PyMem_Free(restr);
    PyMem_Free(aliveset);
    *out = done;
    *nout = ndone;
    return 0;
}

/* query(hashes) -> [PrefixMatch]: every holder of the first block, its consecutive cached prefix; longest first, then
 * most in GPU, then by holder. */
static PyObject *Core_query(Core *c, PyObject *arg) {
    Match *done;
    uint32_t ndone;
    if (walk(c, arg, &done, &ndone) < 0) return NULL;
    for (uint32_t d = 0; d < ndone; d++) done[d].rank = done[d].hid < c->nrank ? c->rank[done[d].hid] : done[d].hid;
    if (ndone) qsort(done, ndone, sizeof(Match), match_cmp);
    PyObject *out = PyList_New(ndone);
    PyTypeObject *tp = (PyTypeObject *)c->pm_type;
    for (uint32_t d = 0; out && d < ndone; d++) {
        PyObject *holder = PyList_GetItem(c->holders, done[d].hid);
        PyObject *t = holder ? tp->tp_alloc(tp, 4) : NULL;
        if (!t) {
            Py_CLEAR(out);
            break;
        }
        Py_INCREF(holder);
        PyTuple_SET_ITEM(t, 0, holder);
        PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(done[d].any));
        PyTuple_SET_ITEM(t, 2, PyLong_FromUnsignedLong(done[d].gpu));
        PyTuple_SET_ITEM(t, 3, PyLong_FromUnsignedLong(done[d].prefix));
        PyList_SET_ITEM(out, d, t);
    }
    PyMem_Free(done);
    return out;
}

/* query_into(hashes, out): the walk's answer by holder id, into `out`, a writable C-contiguous int64 buffer of 3 rows
 * of equal length (blocks_any, blocks_gpu, blocks_gpu_prefix; zeroed by the caller): row[hid] for each holder of the
 * first block. No object per holder and no sort: the router gathers its columns from it. */
static PyObject *Core_query_into(Core *c, PyObject *args) {
    PyObject *seq, *buf;
    if (!PyArg_ParseTuple(args, "OO", &seq, &buf)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (view.itemsize != 8 || !view.format || (strcmp(view.format, "q") && strcmp(view.format, "l")) ||
        view.len % (3 * 8)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "query_into needs an int64 buffer of 3 equal rows");
        return NULL;
    }
    int64_t *rows = view.buf;
    size_t width = (size_t)view.len / (3 * 8);
    Match *done;
    uint32_t ndone;
    if (walk(c, seq, &done, &ndone) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    for (uint32_t d = 0; d < ndone; d++) {
        size_t h = done[d].hid;
        if (h >= width) continue; /* an id the caller did not know of: it cannot have asked about it */
        rows[h] = done[d].any;
        rows[width + h] = done[d].gpu;
        rows[2 * width + h] = done[d].prefix;
    }
    PyMem_Free(done);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(ndone);
}

/* holders_of(hash) -> the mask's set bits as a list of bit positions (GPU 2*id, CPU 2*id+1). */
static PyObject *Core_bits_of(Core *c, PyObject *arg) {
    uint64_t k = PyLong_AsUnsignedLongLongMask(arg);
    if (k == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    uint32_t e = find(c, k);
    if (!e || !out) return out;
    const uint64_t *w = c->mw + (size_t)c->msk[e] * c->nwords;
    for (uint32_t b = 0; b < c->nwords * 64; b++) {
        if ((w[b >> 6] >> (b & 63)) & 1) {
            PyObject *v = PyLong_FromUnsignedLong(b);
            if (!v || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return out;
}

static PyObject *Core_contains(Core *c, PyObject *arg) {
    if (!PyLong_Check(arg)) Py_RETURN_FALSE;
    uint64_t k = PyLong_AsUnsignedLongLongMask(arg);
    if (k == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(find(c, k) != 0);
}

/* keys() -> live hashes, least recently stored first (tests and debugging). */
static PyObject *Core_keys(Core *c, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    for (uint32_t e = c->nxt[0]; out && e; e = c->nxt[e]) {
        PyObject *v = PyLong_FromUnsignedLongLong(c->key[e]);
        if (!v || PyList_Append(out, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

/* check() -> None, or raises AssertionError: the table, the recency list and the mask references agree. */
static PyObject *Core_check(Core *c, PyObject *Py_UNUSED(ignored)) {
    uint32_t n = 0, inslots = 0;
    uint32_t *refs = PyMem_Calloc(c->mused, sizeof(uint32_t));
    if (!refs) return PyErr_NoMemory();
    for (uint32_t e = c->nxt[0], p = 0; e; p = e, e = c->nxt[e]) {
        if (c->prv[e] != p || !c->msk[e] || find(c, c->key[e]) != e) goto bad;
        refs[c->msk[e]]++;
        if (++n > c->count) goto bad;
    }
    for (int t = 0; t < 2; t++) {
        const uint32_t *slots = t ? c->old : c->slots;
        uint32_t size = t ? c->osize : c->tsize, m = size - 1;
        if (!slots) continue;
        for (uint32_t pos = 0; pos < size; pos++) {
            uint32_t s = slots[pos];
            if (!s) continue;
            inslots++;
            uint64_t hk = mix64(c->key[s & IDX_MASK]);
            uint32_t d = (pos - (uint32_t)hk) & m, ps = slots[(pos - 1) & m];
            if ((s & ~IDX_MASK) != (TAG_OF(hk) | ((d < DIST_SAT ? d : DIST_SAT) << DIST_SHIFT))) goto bad;
            if (d && (!ps || d > slot_dist(c, ps, (pos - 1) & m, m) + 1)) goto bad; /* a hole, or out of home order */
        }
    }
    if (n != c->count || inslots != c->count) goto bad;
    for (uint32_t id = 1; id < c->mused; id++)
        if (refs[id] != (c->malive[id] ? c->mref[id] : 0)) goto bad;
    PyMem_Free(refs);
    Py_RETURN_NONE;
bad:
    PyMem_Free(refs);
    PyErr_SetString(PyExc_AssertionError, "KV index core is inconsistent");
    return NULL;
}

static Py_ssize_t Core_len(Core *c) { return c->count; }

static PyObject *Core_nbytes(Core *c, PyObject *Py_UNUSED(ignored)) {
    size_t b = (size_t)c->eused * 20 + ((size_t)c->tsize + c->osize) * 4 +
               (size_t)c->mused * (c->nwords * 8 + 8 + 4 + 1 + 4) + (size_t)c->mtsize * 4 + TC_SIZE * 12;
    return PyLong_FromSize_t(b);
}

static PyObject *Core_get_counters(Core *c, void *Py_UNUSED(closure)) {
    return Py_BuildValue("(LLLI)", c->evictions, c->blocks_stored, c->blocks_removed, c->mlive);
}

/* Slots of the old table still to pass while the table grows (table_grow), else 0. */
static PyObject *Core_get_growing(Core *c, void *Py_UNUSED(closure)) { return PyLong_FromUnsignedLong(c->mig_left); }

static PyObject *Core_get_max(Core *c, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(c->max_entries); }
static int Core_set_max(Core *c, PyObject *v, void *Py_UNUSED(closure)) {
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    c->max_entries = x;
    return 0;
}
static PyObject *Core_get_batch(Core *c, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(c->evict_batch); }
static int Core_set_batch(Core *c, PyObject *v, void *Py_UNUSED(closure)) {
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    c->evict_batch = x;
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------------- */
/* scan: msgpack EventBatch -> records                                                                              */

typedef struct {
    const uint8_t *p, *end;
} Rd;

typedef struct {
    uint64_t *w;
    Py_ssize_t n, cap;
} Out;

static int out_put(Out *o, uint64_t v) {
    if (o->n == o->cap) {
        Py_ssize_t cap = o->cap ? o->cap * 2 : 256;
        uint64_t *w = PyMem_Realloc(o->w, cap * sizeof(uint64_t));
        if (!w) return -1;
        o->w = w;
        o->cap = cap;
    }
    o->w[o->n++] = v;
    return 0;
}

static inline int need(Rd *r, size_t n) { return (size_t)(r->end - r->p) >= n; }
static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static inline uint64_t be64(const uint8_t *p) {
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return __builtin_bswap64(v);
#else
    return be(p, 8);
#endif
}

/* Bytes taken by a fixed-size msgpack value, by its first byte (tag included); 0 for containers, strings, bins, exts
 * of variable size and the never-used 0xc1. */
static uint8_t SCALAR_SIZE[256];

static void init_scalar_size(void) {
    for (int t = 0; t < 0x80; t++) SCALAR_SIZE[t] = 1;
    for (int t = 0xe0; t < 0x100; t++) SCALAR_SIZE[t] = 1;
    SCALAR_SIZE[0xc0] = SCALAR_SIZE[0xc2] = SCALAR_SIZE[0xc3] = 1;
    SCALAR_SIZE[0xcc] = SCALAR_SIZE[0xd0] = 2;
    SCALAR_SIZE[0xcd] = SCALAR_SIZE[0xd1] = 3;
    SCALAR_SIZE[0xce] = SCALAR_SIZE[0xd2] = SCALAR_SIZE[0xca] = 5;
    SCALAR_SIZE[0xcf] = SCALAR_SIZE[0xd3] = SCALAR_SIZE[0xcb] = 9;
    SCALAR_SIZE[0xd4] = 3;
    SCALAR_SIZE[0xd5] = 4;
    SCALAR_SIZE[0xd6] = 6;
    SCALAR_SIZE[0xd7] = 10;
    SCALAR_SIZE[0xd8] = 18;
}

/* Bytes taken by an int's msgpack form, from its first byte: 1 for fixints, 2/3/5/9 for (u)int 8/16/32/64 (0xcc-0xd3,
 * whose low two bits say which). Meaningless for other tags: callers check is_int_tag. */
static inline uint32_t int_size(uint32_t t) {
    uint32_t wide = (uint8_t)(t + 0x20) >= 0xa0; /* 0x80-0xdf: not a fixint */
    return 1 + (wide << (t & 3));
}

/* Bitwise, not ||: which of the two holds is a coin toss per token, a branch on it a misprediction in two. */
static inline uint32_t is_int_tag(uint32_t t) { return ((uint8_t)(t + 0x20) < 0xa0) | (t - 0xcc < 8); }

/* Skipping token ids with SIMD (x86-64: SSSE3 or AVX2, chosen at import; elsewhere, or on older CPUs, the scalar
 * loop below does it all). Each int's size comes from its tag, so the scalar loop is one chain of dependent steps,
 * a load and some arithmetic per item. Here the payload is cut into 16-byte windows at fixed offsets, and for each
 * window, for every byte i in it taken as the start of an item, pointer doubling (4 rounds of pshufb: a chain of up
 * to 16 items in 4 steps) finds where the chain of ints from i leaves the window (16 to 24 bytes from its start) and
 * how many items it takes. Those tables depend only on the window's bytes, so the CPU builds them for windows ahead
 * while the one chain left, window to window (a table lookup each, ~7 items), runs behind. A window whose chain from
 * its entry meets a byte that is not an int tag, or holds more items than are left, ends the walk; the scalar loop
 * takes it from there, so what is skipped is what the scalar loop would skip. Reads stay within [p, end): a window
 * is walked only with 25 bytes left from its start (its 16, plus an int of up to 9 bytes starting in its last). */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KV_X86 1
#include <immintrin.h>
#endif

static int simd_level, simd_max; /* 0 scalar, 1 SSSE3, 2 AVX2: what skip_ints uses, what the CPU has */

#ifdef KV_X86
#define WIN_NEED 25

/* The walk's one serial step: from entry e, the window's table says where the chain leaves it (16-24) and how many
 * items it took; 0 where it ends inside the window (not an int) or would take more items than are left. */
static inline int win_step(const uint16_t *tab, uint32_t *e, uint64_t *left, const uint8_t **p) {
    uint32_t v = tab[*e], xe = v & 0xff, ce = v >> 8;
    if (xe < 16 || ce > *left) return 0;
    *left -= ce;
    *e = xe - 16;
    *p += 16;
    return 1;
}

__attribute__((target("ssse3"))) static const uint8_t *skip_ints_ssse3(const uint8_t *p, const uint8_t *end,
                                                                       uint64_t *n) {
    const __m128i iota = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* sizes of 0xcc-0xd3 ((u)int 8/16/32/64) by tag - 0xcc; 8-15 (other tags that the saturating add leaves below
     * 0x80) size 0 */
    const __m128i wide = _mm_setr_epi8(2, 3, 5, 9, 2, 3, 5, 9, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i one = _mm_set1_epi8(1), sixteen = _mm_set1_epi8(16), zero = _mm_setzero_si128();
    uint64_t left = *n;
    uint32_t e = 0; /* where the chain enters the window at p */
    uint16_t tab[16];
    while (end - p >= WIN_NEED) {
        __m128i b = _mm_loadu_si128((const __m128i *)p);
        __m128i fix = _mm_cmpgt_epi8(b, _mm_set1_epi8(-33)); /* 0x00-0x7f and 0xe0-0xff: fixints, one byte */
        __m128i u = _mm_adds_epu8(_mm_sub_epi8(b, _mm_set1_epi8((char)0xcc)), _mm_set1_epi8(0x70));
        __m128i s = _mm_or_si128(_mm_and_si128(fix, one), _mm_shuffle_epi8(wide, u)); /* item size, 0: no int */
        __m128i t = _mm_add_epi8(iota, s);
        /* f: the next item's start, or i itself where the chain ends at i (no int, or the next starts past the
         * window); c: items the chain from i takes before where f leads */
        __m128i ok = _mm_andnot_si128(_mm_cmpeq_epi8(s, zero), _mm_cmpgt_epi8(sixteen, t));
        __m128i f = _mm_or_si128(_mm_and_si128(ok, t), _mm_andnot_si128(ok, iota));
        __m128i c = _mm_and_si128(ok, one);
        for (int k = 0; k < 4; k++) {
            c = _mm_add_epi8(c, _mm_shuffle_epi8(c, f));
            f = _mm_shuffle_epi8(f, f);
        }
        __m128i sl = _mm_shuffle_epi8(s, f);                  /* the size of the chain's last item in the window */
        __m128i x = _mm_add_epi8(f, sl);                      /* where it leaves: 16-24, or below 16: not an int */
        c = _mm_add_epi8(c, _mm_min_epu8(sl, one));
        _mm_storeu_si128((__m128i *)tab, _mm_unpacklo_epi8(x, c));
        _mm_storeu_si128((__m128i *)(tab + 8), _mm_unpackhi_epi8(x, c));
        if (!win_step(tab, &e, &left, &p)) break;
    }
    *n = left;
    return p + e;
}

/* The same, two windows at a time (vpshufb shuffles each 16-byte lane on its own: one lane, one window). */
__attribute__((target("avx2"))) static const uint8_t *skip_ints_avx2(const uint8_t *p, const uint8_t *end,
                                                                     uint64_t *n) {
    const __m256i iota = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6,
                                          7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i wide = _mm256_setr_epi8(2, 3, 5, 9, 2, 3, 5, 9, 0, 0, 0, 0, 0, 0, 0, 0, 2, 3, 5, 9, 2, 3, 5, 9, 0, 0,
                                          0, 0, 0, 0, 0, 0);
    const __m256i one = _mm256_set1_epi8(1), sixteen = _mm256_set1_epi8(16), zero = _mm256_setzero_si256();
    uint64_t left = *n;
    uint32_t e = 0;
    uint16_t tab[32];
    while (end - p >= 16 + WIN_NEED) {
        __m256i b = _mm256_loadu_si256((const __m256i *)p);
        __m256i fix = _mm256_cmpgt_epi8(b, _mm256_set1_epi8(-33));
        __m256i u = _mm256_adds_epu8(_mm256_sub_epi8(b, _mm256_set1_epi8((char)0xcc)), _mm256_set1_epi8(0x70));
        __m256i s = _mm256_or_si256(_mm256_and_si256(fix, one), _mm256_shuffle_epi8(wide, u));
        __m256i t = _mm256_add_epi8(iota, s);
        __m256i ok = _mm256_andnot_si256(_mm256_cmpeq_epi8(s, zero), _mm256_cmpgt_epi8(sixteen, t));
        __m256i f = _mm256_or_si256(_mm256_and_si256(ok, t), _mm256_andnot_si256(ok, iota));
        __m256i c = _mm256_and_si256(ok, one);
        for (int k = 0; k < 4; k++) {
            c = _mm256_add_epi8(c, _mm256_shuffle_epi8(c, f));
            f = _mm256_shuffle_epi8(f, f);
        }
        __m256i sl = _mm256_shuffle_epi8(s, f);
        __m256i x = _mm256_add_epi8(f, sl);
        c = _mm256_add_epi8(c, _mm256_min_epu8(sl, one));
        __m256i lo = _mm256_unpacklo_epi8(x, c), hi = _mm256_unpackhi_epi8(x, c);
        _mm256_storeu_si256((__m256i *)tab, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(tab + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
        if (!win_step(tab, &e, &left, &p) || !win_step(tab + 16, &e, &left, &p)) break;
    }
    *n = left;
    return p + e;
}
#endif

/* Skip up to *n ints (token ids, the bulk of a payload): stops at anything else, or near the end, for the generic
 * loop. The chain from one item's position to the next bounds this loop: here the position stays in a register
 * (the generic loop stored and reloaded it through the Rd), sizes come from the tag by arithmetic, not a table, and
 * two items come from one 8-byte load (little-endian machines). About 7% off scan() on the benchmark's payloads. */
static inline const uint8_t *skip_ints(const uint8_t *p, const uint8_t *end, uint64_t *n) {
    uint64_t left = *n;
#ifdef KV_X86
    if (simd_level && left >= 16 && end - p >= WIN_NEED)
        p = simd_level == 2 && end - p >= 16 + WIN_NEED ? skip_ints_avx2(p, end, &left) : skip_ints_ssse3(p, end, &left);
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    while (left >= 2 && end - p >= 18) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint32_t t0 = (uint32_t)w & 0xff, s0 = int_size(t0);
        uint32_t t1 = (uint32_t)(w >> (8 * (s0 & 7))) & 0xff;
        if (!(is_int_tag(t0) & is_int_tag(t1) & (s0 <= 5))) break; /* the second tag must lie in these 8 bytes */
        p += s0 + int_size(t1);
        left -= 2;
    }
#endif
    while (left && end - p >= 9) {
        uint32_t t = *p;
        if (!is_int_tag(t)) break;
        p += int_size(t);
        left--;
    }
    *n = left;
    return p;
}

/* ASCII, 8 bytes at a time (a map's keys are most of the strings in a payload): msgspec checks anything else. */
static int ascii_only(const uint8_t *q, uint64_t n) {
    uint64_t hi = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x;
        memcpy(&x, q + i, 8);
        hi |= x;
    }
    for (; i < n; i++) hi |= q[i];
    return !(hi & 0x8080808080808080ULL);
}

/* Skip one msgpack value; 0 if malformed or too deep. */
static int skip(Rd *r, int depth) {
    if (depth > 64 || !need(r, 1)) return 0;
    uint8_t t = *r->p++;
    uint64_t n;
    if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) return 1;
    if ((t & 0xf0) == 0x80 || (t & 0xf0) == 0x90) {
        n = (t & 0x0f) * ((t & 0xf0) == 0x80 ? 2 : 1);
        goto items;
    }
    if ((t & 0xe0) == 0xa0) {
        n = t & 0x1f;
        goto str;
    }
    switch (t) {
        case 0xc4: if (!need(r, 1)) return 0; n = be(r->p, 1); r->p += 1; goto bytes;
        case 0xc5: if (!need(r, 2)) return 0; n = be(r->p, 2); r->p += 2; goto bytes;
        case 0xc6: if (!need(r, 4)) return 0; n = be(r->p, 4); r->p += 4; goto bytes;
        case 0xd9: if (!need(r, 1)) return 0; n = be(r->p, 1); r->p += 1; goto str;
        case 0xda: if (!need(r, 2)) return 0; n = be(r->p, 2); r->p += 2; goto str;
        case 0xdb: if (!need(r, 4)) return 0; n = be(r->p, 4); r->p += 4; goto str;
        case 0xc7: if (!need(r, 1)) return 0; n = be(r->p, 1) + 1; r->p += 1; goto bytes;
        case 0xc8: if (!need(r, 2)) return 0; n = be(r->p, 2) + 1; r->p += 2; goto bytes;
        case 0xc9: if (!need(r, 4)) return 0; n = be(r->p, 4) + 1; r->p += 4; goto bytes;
        case 0xca: n = 4; goto bytes;
        case 0xcb: n = 8; goto bytes;
        case 0xcc: case 0xd0: n = 1; goto bytes;
        case 0xcd: case 0xd1: n = 2; goto bytes;
        case 0xce: case 0xd2: n = 4; goto bytes;
        case 0xcf: case 0xd3: n = 8; goto bytes;
        case 0xd4: n = 2; goto bytes;
        case 0xd5: n = 3; goto bytes;
        case 0xd6: n = 5; goto bytes;
        case 0xd7: n = 9; goto bytes;
        case 0xd8: n = 17; goto bytes;
        case 0xdc: if (!need(r, 2)) return 0; n = be(r->p, 2); r->p += 2; goto items;
        case 0xdd: if (!need(r, 4)) return 0; n = be(r->p, 4); r->p += 4; goto items;
        case 0xde: if (!need(r, 2)) return 0; n = be(r->p, 2) * 2; r->p += 2; goto items;
        case 0xdf: if (!need(r, 4)) return 0; n = be(r->p, 4) * 2; r->p += 4; goto items;
        default: return 0; /* 0xc1 */
    }
str:
    /* A skipped string must be ASCII too (as rd_str's): the events are decoded again lazily by msgspec, which checks
     * UTF-8, and a batch accepted here must not fail there. Anything else goes to msgspec now. */
    if (!need(r, n) || !ascii_only(r->p, n)) return 0;
    r->p += n;
    return 1;
bytes:
    if (!need(r, n)) return 0;
    r->p += n;
    return 1;
items:
    if (n > (uint64_t)(r->end - r->p)) return 0; /* every item takes a byte at least */
    /* runs of ints skip fast; other scalars by table, without recursion */
    while (n) {
        const uint8_t *p = r->p = skip_ints(r->p, r->end, &n);
        if (!n) break;
        if (p >= r->end) return 0;
        uint8_t sz = SCALAR_SIZE[*p];
        if (sz) {
            if (r->end - p < sz) return 0;
            r->p = p + sz;
        } else if (!skip(r, depth + 1)) {
            return 0;
        }
        n--;
    }
    return 1;
}

static int is_nil(Rd *r) {
    if (need(r, 1) && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* An int (any msgpack int type); its 64-bit two's complement form in *v. */
static int rd_int(Rd *r, uint64_t *v) {
    if (!need(r, 1)) return 0;
    uint8_t t = *r->p;
    if (t <= 0x7f) { *v = t; r->p++; return 1; }
    if (t >= 0xe0) { *v = (uint64_t)(int64_t)(int8_t)t; r->p++; return 1; }
    if (t == 0xcf || t == 0xd3) { /* 64 bits: block hashes, one load (the loop below takes a dependent step a byte) */
        if (!need(r, 9)) return 0;
        *v = be64(r->p + 1);
        r->p += 9;
        return 1;
    }
    int n;
    int sgn = 0;
    switch (t) {
        case 0xcc: n = 1; break;
        case 0xcd: n = 2; break;
        case 0xce: n = 4; break;
        case 0xcf: n = 8; break;
        case 0xd0: n = 1; sgn = 1; break;
        case 0xd1: n = 2; sgn = 1; break;
        case 0xd2: n = 4; sgn = 1; break;
        case 0xd3: n = 8; sgn = 1; break;
        default: return 0;
    }
    if (!need(r, 1 + n)) return 0;
    uint64_t x = be(r->p + 1, n);
    if (sgn && n < 8 && (x >> (8 * n - 1)) & 1) x |= ~0ULL << (8 * n);
    *v = x;
    r->p += 1 + n;
    return 1;
}

static int rd_len(Rd *r, int map, uint64_t *n) {
    if (!need(r, 1)) return 0;
    uint8_t t = *r->p;
    uint8_t fix = map ? 0x80 : 0x90, b16 = map ? 0xde : 0xdc, b32 = map ? 0xdf : 0xdd;
    if ((t & 0xf0) == fix) { *n = t & 0x0f; r->p++; return 1; }
    if (t == b16 && need(r, 3)) { *n = be(r->p + 1, 2); r->p += 3; return 1; }
    if (t == b32 && need(r, 5)) { *n = be(r->p + 1, 4); r->p += 5; return 1; }
    return 0;
}

/* A str of ASCII bytes (anything else goes to msgspec, which checks UTF-8). */
static int rd_str(Rd *r, const uint8_t **s, uint32_t *len) {
    if (!need(r, 1)) return 0;
    uint8_t t = *r->p;
    uint64_t n;
    int h;
    if ((t & 0xe0) == 0xa0) { n = t & 0x1f; h = 1; }
    else if (t == 0xd9 && need(r, 2)) { n = be(r->p + 1, 1); h = 2; }
    else if (t == 0xda && need(r, 3)) { n = be(r->p + 1, 2); h = 3; }
    else return 0;
    if (!need(r, h + n)) return 0;
    if (!ascii_only(r->p + h, n)) return 0;
    *s = r->p + h;
    *len = (uint32_t)n;
    r->p += h + n;
    return 1;
}

enum { F_HASHES, F_PARENT, F_ANY, F_INT, F_INT_NIL, F_MEDIUM, F_STR_NIL, F_EXTRA };
/* A string as msgpack writes it (a fixstr: header byte, then the bytes), in 8-byte words, to compare a payload's bytes
 * with a word at a time: map keys and event tags are most of the strings a payload holds. */
typedef struct {
    uint64_t w[4], last_mask; /* words, zero-padded; the bytes of the last word that count */
    uint32_t nwords, len;     /* len: header included */
} Lit;

static void lit_init(Lit *l, const char *s) {
    uint8_t b[32] = {0}, m[8] = {0};
    size_t n = strlen(s); /* < 31: a fixstr */
    b[0] = (uint8_t)(0xa0 | n);
    memcpy(b + 1, s, n);
    l->len = (uint32_t)n + 1;
    l->nwords = (l->len + 7) / 8;
    memcpy(l->w, b, sizeof l->w);
    memset(m, 0xff, l->len - 8 * (l->nwords - 1));
    memcpy(&l->last_mask, m, 8);
}

/* 1 if the bytes at p are l (needs whole words there: near the end, 0, and the caller reads the slow way). */
static inline int lit_at(const uint8_t *p, const uint8_t *end, const Lit *l) {
    uint32_t nw = l->nwords;
    if ((size_t)(end - p) < (size_t)nw * 8) return 0;
    uint64_t d = 0, x;
    for (uint32_t k = 0; k + 1 < nw; k++) {
        memcpy(&x, p + 8 * k, 8);
        d |= x ^ l->w[k];
    }
    memcpy(&x, p + 8 * (nw - 1), 8);
    return !(d | ((x ^ l->w[nw - 1]) & l->last_mask));
}

typedef struct {
    const char *name;
    int type;
    uint32_t len; /* filled in at import */
    Lit key;      /* likewise */
} Field;

static Lit LIT_TYPE, LIT_STORED; /* "type", "BlockStored" */

/* Field order as in llmd.kv.events (and vLLM): the array form is positional. */
static Field STORED_FIELDS[] = {
    {"block_hashes", F_HASHES}, {"parent_block_hash", F_PARENT}, {"token_ids", F_ANY},
    {"block_size", F_INT}, {"lora_id", F_INT_NIL}, {"medium", F_MEDIUM},
    {"lora_name", F_STR_NIL}, {"extra_keys", F_EXTRA}, {"group_idx", F_INT_NIL},
    {"kv_cache_spec_kind", F_STR_NIL}, {"kv_cache_spec_sliding_window", F_INT_NIL}, {"locality", F_STR_NIL},
    {"ownership", F_STR_NIL}, {"session_id", F_STR_NIL},
};
#define STORED_NF 14
#define STORED_REQ_MAP 7
#define STORED_REQ_ARR 4
static Field REMOVED_FIELDS[] = {
    {"block_hashes", F_HASHES}, {"medium", F_MEDIUM}, {"group_idx", F_INT_NIL}, {"locality", F_STR_NIL},
    {"ownership", F_STR_NIL},
};
#define REMOVED_NF 5
#define REMOVED_REQ_MAP 2
#define REMOVED_REQ_ARR 1

typedef struct {
    Py_ssize_t hashes_at; /* index in Out of the first hash */
    uint32_t nhashes;
    int gpu;
} EvState;

static int rd_field(Rd *r, int type, Out *o, EvState *st) {
    uint64_t v, n;
    const uint8_t *s;
    uint32_t len;
    switch (type) {
        case F_HASHES:
            if (!rd_len(r, 0, &n) || n > (uint64_t)(r->end - r->p)) return 0;
            if (st->hashes_at >= 0) return 0;
            st->hashes_at = o->n;
            st->nhashes = (uint32_t)n;
            for (uint64_t i = 0; i < n; i++)
                if (!rd_int(r, &v) || out_put(o, v) < 0) return 0;
            return 1;
        case F_PARENT:
        case F_INT_NIL:
            return is_nil(r) || rd_int(r, &v);
        case F_INT:
            return rd_int(r, &v);
        case F_ANY:
            return skip(r, 0);
        case F_MEDIUM:
            if (is_nil(r)) {
                st->gpu = 1;
                return 1;
            }
            if (!rd_str(r, &s, &len)) return 0;
            st->gpu = len == 3 && (!memcmp(s, "GPU", 3) || !memcmp(s, "gpu", 3));
            return 1;
        case F_STR_NIL:
            return is_nil(r) || rd_str(r, &s, &len);
        case F_EXTRA:
            if (is_nil(r)) return 1;
            if (!rd_len(r, 0, &n)) return 0;
            for (uint64_t i = 0; i < n; i++) {
                if (is_nil(r)) continue;
                if (!need(r, 1)) return 0;
                uint8_t t = *r->p;
                if (!((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) || !skip(r, 0)) return 0;
            }
            return 1;
    }
    return 0;
}

/* One event into records; 0: not a plain event this path takes (msgspec decides instead). */
static int scan_event(Rd *r, const uint8_t *base, Out *o) {
    const uint8_t *start = r->p;
    uint64_t n;
    int map;
    if (rd_len(r, 1, &n)) map = 1;
    else if (rd_len(r, 0, &n)) map = 0;
    else return 0;
    if (n == 0) return 0;
    const uint8_t *s;
    uint32_t len;
    if (map) {
        if (lit_at(r->p, r->end, &LIT_TYPE)) r->p += LIT_TYPE.len;
        else if (!rd_str(r, &s, &len) || len != 4 || memcmp(s, "type", 4)) return 0;
    }
    int kind;
    const Field *fields;
    int nf, req;
    if (lit_at(r->p, r->end, &LIT_STORED)) { /* the common tag, as bytes: else read and compared below */
        r->p += LIT_STORED.len;
        s = (const uint8_t *)"BlockStored", len = 11;
    } else if (!rd_str(r, &s, &len)) {
        return 0;
    }
    if (len == 11 && !memcmp(s, "BlockStored", 11)) {
        kind = REC_STORED, fields = STORED_FIELDS, nf = STORED_NF, req = map ? STORED_REQ_MAP : STORED_REQ_ARR;
    } else if (len == 12 && !memcmp(s, "BlockRemoved", 12)) {
        kind = REC_REMOVED, fields = REMOVED_FIELDS, nf = REMOVED_NF, req = map ? REMOVED_REQ_MAP : REMOVED_REQ_ARR;
    } else if (len == 16 && !memcmp(s, "AllBlocksCleared", 16)) {
        kind = REC_CLEARED, fields = NULL, nf = 0, req = 0;
    } else {
        return 0;
    }
    Py_ssize_t hd = o->n;
    if (out_put(o, 0) < 0 || out_put(o, 0) < 0) return 0;
    EvState st = {-1, 0, 1};
    uint32_t seen = 0;
    int next_f = 0;
    if (map) {
        for (uint64_t i = 1; i < n; i++) {
            /* publishers write fields in declaration order: try the one after the last first, as bytes */
            int f = next_f;
            if (f < nf && lit_at(r->p, r->end, &fields[f].key)) {
                r->p += fields[f].key.len;
            } else {
                if (!rd_str(r, &s, &len)) return 0;
                if (!(f < nf && fields[f].len == len && !memcmp(fields[f].name, s, len)))
                    for (f = 0; f < nf; f++)
                        if (fields[f].len == len && !memcmp(fields[f].name, s, len)) break;
                if (f == nf) {
                    next_f = f + 1;
                    if (len == 4 && !memcmp(s, "type", 4)) return 0;
                    if (!skip(r, 0)) return 0;
                    continue;
                }
            }
            next_f = f + 1;
            if (seen & (1u << f)) return 0;
            seen |= 1u << f;
            if (!rd_field(r, fields[f].type, o, &st)) return 0;
        }
        if ((seen & ((1u << req) - 1)) != (1u << req) - 1) return 0;
    } else {
        if (n - 1 < (uint64_t)req || n - 1 > (uint64_t)nf) return 0;
        for (uint64_t f = 0; f + 1 < n; f++)
            if (!rd_field(r, fields[f].type, o, &st)) return 0;
    }
    if (kind == REC_CLEARED) st.nhashes = 0;
    o->w[hd] = (uint64_t)kind | ((uint64_t)st.gpu << 8) | ((uint64_t)(!map) << 9) | ((uint64_t)st.nhashes << 32);
    o->w[hd + 1] = (uint64_t)(start - base) | ((uint64_t)(r->p - base) << 32);
    return 1;
}

/* scan(payload) -> (ts, data_parallel_rank, records, n_stored, n_removed, n_cleared) or None. */
static PyObject *scan(PyObject *Py_UNUSED(mod), PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Rd r = {buf.buf, (const uint8_t *)buf.buf + buf.len};
    Out o = {NULL, 0, 0};
    uint64_t n, nev;
    double ts;
    PyObject *rank = NULL, *res = NULL;
    long long counts[3] = {0, 0, 0};
    if (buf.len > 0xFFFFFFFFLL || !rd_len(&r, 0, &n) || n < 2 || n > 3 || !need(&r, 1)) goto none;
    if (*r.p == 0xcb && need(&r, 9)) {
        uint64_t x = be(r.p + 1, 8);
        memcpy(&ts, &x, 8);
        r.p += 9;
    } else if (*r.p == 0xca && need(&r, 5)) {
        uint32_t x = (uint32_t)be(r.p + 1, 4);
        float f;
        memcpy(&f, &x, 4);
        ts = f;
        r.p += 5;
    } else {
        goto none;
    }
    if (!rd_len(&r, 0, &nev) || nev > (uint64_t)(r.end - r.p)) goto none;
    for (uint64_t i = 0; i < nev; i++) {
        Py_ssize_t at = o.n;
        if (!scan_event(&r, buf.buf, &o)) goto none;
        counts[o.w[at] & 0xFF]++;
    }
    if (n == 3) {
        uint64_t v;
        if (is_nil(&r)) {
            rank = Py_None;
            Py_INCREF(rank);
        } else if (need(&r, 1) && (*r.p <= 0x7f || *r.p == 0xcc || *r.p == 0xcd || *r.p == 0xce) && rd_int(&r, &v)) {
            rank = PyLong_FromUnsignedLongLong(v);
        } else {
            goto none;
        }
    } else {
        rank = Py_None;
        Py_INCREF(rank);
    }
    if (r.p != r.end) goto none; /* trailing bytes: msgspec calls that an error */
    PyObject *recs = PyBytes_FromStringAndSize((const char *)o.w, o.n * 8);
    if (recs) res = Py_BuildValue("(dNNLLL)", ts, rank, recs, counts[0], counts[1], counts[2]);
    else Py_DECREF(rank);
    PyMem_Free(o.w);
    PyBuffer_Release(&buf);
    return res;
none:
    Py_XDECREF(rank);
    PyMem_Free(o.w);
    PyBuffer_Release(&buf);
    if (PyErr_Occurred()) PyErr_Clear();
    Py_RETURN_NONE;
}

static PyMethodDef Core_methods[] = {
    {"ensure_holders", (PyCFunction)Core_ensure_holders, METH_O, NULL},
    {"store", (PyCFunction)Core_store, METH_VARARGS, NULL},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, NULL},
    {"evict", (PyCFunction)Core_evict, METH_NOARGS, NULL},
    {"apply_records", (PyCFunction)Core_apply_records, METH_VARARGS, NULL},
    {"clear", (PyCFunction)Core_clear, METH_O, NULL},
    {"set_order", (PyCFunction)Core_set_order, METH_O, NULL},
    {"query", (PyCFunction)Core_query, METH_O, NULL},
    {"query_into", (PyCFunction)Core_query_into, METH_VARARGS, NULL},
    {"bits_of", (PyCFunction)Core_bits_of, METH_O, NULL},
    {"contains", (PyCFunction)Core_contains, METH_O, NULL},
    {"keys", (PyCFunction)Core_keys, METH_NOARGS, NULL},
    {"check", (PyCFunction)Core_check, METH_NOARGS, NULL},
    {"nbytes", (PyCFunction)Core_nbytes, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"counters", (getter)Core_get_counters, NULL, NULL, NULL},
    {"max_entries", (getter)Core_get_max, (setter)Core_set_max, NULL, NULL},
    {"evict_batch", (getter)Core_get_batch, (setter)Core_set_batch, NULL, NULL},
    {"growing", (getter)Core_get_growing, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Core_as_seq = {.sq_length = (lenfunc)Core_len};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmd.kv._kvnative.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
    .tp_as_sequence = &Core_as_seq,
};

/* simd_level(level) -> the level scan's int skipping now uses (0 scalar, 1 SSSE3, 2 AVX2): `level`, or the most
 * this CPU has if that is less; -1 leaves it as it is. For tests, which compare the levels' answers. */
static PyObject *set_simd_level(PyObject *Py_UNUSED(mod), PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v >= 0) simd_level = v < simd_max ? (int)v : simd_max;
    return PyLong_FromLong(simd_level);
}

static PyMethodDef module_methods[] = {
    {"scan", (PyCFunction)scan, METH_O, NULL},
    {"simd_level", (PyCFunction)set_simd_level, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_kvnative", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__kvnative(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    init_scalar_size();
#ifdef KV_X86
    __builtin_cpu_init();
    simd_max = __builtin_cpu_supports("avx2") ? 2 : __builtin_cpu_supports("ssse3") ? 1 : 0;
    simd_level = simd_max;
#endif
    lit_init(&LIT_TYPE, "type");
    lit_init(&LIT_STORED, "BlockStored");
    for (int f = 0; f < STORED_NF; f++) {
        STORED_FIELDS[f].len = (uint32_t)strlen(STORED_FIELDS[f].name);
        lit_init(&STORED_FIELDS[f].key, STORED_FIELDS[f].name);
    }
    for (int f = 0; f < REMOVED_NF; f++) {
        REMOVED_FIELDS[f].len = (uint32_t)strlen(REMOVED_FIELDS[f].name);
        lit_init(&REMOVED_FIELDS[f].key, REMOVED_FIELDS[f].name);
    }
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
