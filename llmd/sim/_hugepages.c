/* The simulator's heap in transparent huge pages (hugepages.py is its Python side).
 *
 * Why: a 544-GPU run holds gigabytes of Python objects (requests, contexts, block lists, the engines' and router's
 * state) and each event touches a rank nothing has touched for a while, so most reads miss the TLB as well as the
 * caches. With 4 KB pages a 2 GB heap is half a million pages, far beyond the TLB; with 2 MB pages, a thousand.
 * Measured on the calibrated 544-GPU run (3,000 agents, 240 simulated s, paired on two cores, off -> on): 67.1 -> 61.9,
 * 71.8 -> 66.8, 44.3 -> 44.6 and 54.2 -> 45.0 s (the gain largest when other jobs load the machine, never slower). What
 * pointed here: PYTHONMALLOC=malloc ran 80.0 and 71.2 s, and 73.2 and 64.3 s with glibc's own huge-page tunable.
 *
 * Two parts, both only where the system leaves huge pages to the program (THP "madvise" or "always"):
 * - arenas: Python's small-object allocator takes its 1 MB arenas from here (PyObject_SetArenaAllocator): one region
 *   reserved up front (address space only, MAP_NORESERVE), marked MADV_HUGEPAGE before anything is written, so the
 *   kernel backs it with huge pages as it is first touched. Arenas Python frees go on a free list and are handed out
 *   again (kept, not unmapped: giving a piece back would split its huge page). Arenas of another size, and any once the
 *   region is used up, come from the allocator that was there before, which also frees whatever it handed out.
 * - malloc: glibc's main heap grows by brk; grow_heap() marks what it grew by since the last call. glibc is asked to
 *   grow it 64 MB at a time (M_TOP_PAD), so most of each growth is still untouched when it is marked, and is then
 *   backed by huge pages as it is touched (already-touched pages stay small until khugepaged collapses them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <malloc.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define HUGE_PAGE ((uintptr_t)2 << 20)
#define TOP_PAD ((int)(64 << 20))

static PyObjectArenaAllocator prev;
static char *base = NULL;
static size_t cap = 0, used = 0, arena_size = 0;
static void *free_head = NULL;
static unsigned long long n_new = 0, n_reused = 0, n_freed = 0, n_elsewhere = 0;
static uintptr_t heap_marked = 0;

static inline uintptr_t up(uintptr_t p) { return (p + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

static void *arena_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (size == arena_size) {
        if (free_head) {
            void *p = free_head;
            free_head = *(void **)p;
            n_reused++;
            return p;
        }
        if (size <= cap - used) {
            void *p = base + used;
            used += size;
            n_new++;
            return p;
        }
    }
    n_elsewhere++;
    return prev.alloc(prev.ctx, size);
}

static void arena_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    if ((char *)ptr >= base && (char *)ptr < base + cap) {
        *(void **)ptr = free_head;
        free_head = ptr;
        n_freed++;
        return;
    }
    prev.free(prev.ctx, ptr, size);
}

/* use_arenas(region_bytes, arena_bytes) -> bool: Python's arenas from a huge-page region from now on (False where
 * the region could not be reserved or marked, or it is in use already). */
static PyObject *use_arenas(PyObject *self, PyObject *args) {
    unsigned long long region, asize;
    (void)self;
    if (!PyArg_ParseTuple(args, "KK", &region, &asize)) return NULL;
    if (base != NULL || asize == 0 || region < asize) Py_RETURN_FALSE;
#ifdef MADV_HUGEPAGE
    size_t want = (size_t)region;
    void *p = mmap(NULL, want + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) Py_RETURN_FALSE;
    char *b = (char *)up((uintptr_t)p);
    if (madvise(b, want, MADV_HUGEPAGE) != 0) {
        munmap(p, want + HUGE_PAGE);
        Py_RETURN_FALSE;
    }
    base = b;
    cap = want;
    arena_size = (size_t)asize;
    PyObject_GetArenaAllocator(&prev);
    PyObjectArenaAllocator mine = {NULL, arena_alloc, arena_free};
    PyObject_SetArenaAllocator(&mine);
    Py_RETURN_TRUE;
#else
    (void)region;
    (void)asize;
    Py_RETURN_FALSE;
#endif
}

/* grow_heap() -> bytes newly marked: glibc's brk heap grown since the last call, marked for huge pages (the first
 * call asks glibc to grow it in 64 MB steps from then on). */
static PyObject *grow_heap(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
#ifdef MADV_HUGEPAGE
    uintptr_t brk = (uintptr_t)sbrk(0);
    if (brk == (uintptr_t)-1) return PyLong_FromLong(0);
    if (heap_marked == 0) {
        mallopt(M_TOP_PAD, TOP_PAD);
        heap_marked = up(brk); /* what is there now is written already: left as it is */
        return PyLong_FromLong(0);
    }
    uintptr_t end = brk & ~(HUGE_PAGE - 1);
    if (end <= heap_marked) return PyLong_FromLong(0);
    uintptr_t from = heap_marked;
    heap_marked = end;
    if (madvise((void *)from, end - from, MADV_HUGEPAGE) != 0) return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong((unsigned long long)(end - from));
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *stats(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K}", "arenas_new", n_new, "arenas_reused", n_reused, "arenas_freed",
                         n_freed, "arenas_elsewhere", n_elsewhere, "arena_bytes", (unsigned long long)used,
                         "heap_marked_to", (unsigned long long)heap_marked);
}

static PyMethodDef methods[] = {
    {"use_arenas", use_arenas, METH_VARARGS,
     "use_arenas(region_bytes, arena_bytes) -> bool: Python's object arenas from a huge-page region from now on."},
    {"grow_heap", grow_heap, METH_NOARGS, "grow_heap() -> bytes of glibc's heap newly marked for huge pages."},
    {"stats", stats, METH_NOARGS, "Counters: arenas handed out new, reused, freed, taken elsewhere; bytes used."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hugepages", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hugepages(void) { return PyModule_Create(&module); }
