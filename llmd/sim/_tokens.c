/* The cluster simulator's pseudo-random token runs in C: tokens.py's run_tokens, the same values.
 *
 * Why: agents' contexts and engines' outputs read their tokens on demand (a turn's new tokens to hash, a decode's
 * output), and numpy's fixed cost per call plus its array-to-list conversion made that ~6% of a 544-GPU run. The
 * tokens a context's new blocks hash come packed as int64s (span_packed), never as int objects (~1M a simulated
 * second): the block hasher's C pickle reads them there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* splitmix64 of (seed, position) modulo the vocabulary. */
static inline uint64_t token_at(uint64_t seed, Py_ssize_t pos, uint64_t vocab) {
    uint64_t x = (uint64_t)pos * 0x9E3779B97F4A7C15ULL + seed;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x % vocab;
}

/* (seed, start, stop, vocab) as both functions take them; the count of tokens in *n. 0 on an error set. */
static int parse_run(PyObject *args, uint64_t *seed, Py_ssize_t *start, Py_ssize_t *n, uint64_t *vocab) {
    PyObject *seed_obj;
    Py_ssize_t stop;
    long long v;
    if (!PyArg_ParseTuple(args, "OnnL", &seed_obj, start, &stop, &v)) return 0;
    if (v < 1) {
        PyErr_SetString(PyExc_ValueError, "vocab must be >= 1");
        return 0;
    }
    *seed = PyLong_AsUnsignedLongLongMask(seed_obj); /* seed & (2**64 - 1), negatives too */
    if (*seed == (uint64_t)-1 && PyErr_Occurred()) return 0;
    if (*start < 0) {
        PyErr_SetString(PyExc_ValueError, "start must be >= 0");
        return 0;
    }
    *n = stop > *start ? stop - *start : 0;
    *vocab = (uint64_t)v;
    return 1;
}

/* One int object per token id, shared by every list run_tokens makes (vocabularies up to CACHE_MAX ids): engines'
 * outputs are lists of ints (~800 a request at 3,000 agents), and making and freeing an int object for each was ~3% of
 * a 544-GPU run; a shared one costs a reference. Kept for the process's life (32,000 ids: ~1.3 MB). */
#define CACHE_MAX (1 << 20)
static PyObject **token_objs = NULL;
static Py_ssize_t token_objs_n = 0;

static PyObject *token_obj(uint64_t t, uint64_t vocab) {
    if (t >= (uint64_t)token_objs_n) {
        if (vocab > CACHE_MAX) return PyLong_FromUnsignedLongLong(t);
        PyObject **grown = PyMem_Realloc(token_objs, sizeof(PyObject *) * (size_t)vocab);
        if (grown == NULL) return PyErr_NoMemory();
        memset(grown + token_objs_n, 0, sizeof(PyObject *) * (size_t)((Py_ssize_t)vocab - token_objs_n));
        token_objs = grown;
        token_objs_n = (Py_ssize_t)vocab;
    }
    PyObject *o = token_objs[t];
    if (o == NULL) {
        o = token_objs[t] = PyLong_FromUnsignedLongLong(t);
        if (o == NULL) return NULL;
    }
    return Py_NewRef(o);
}

static PyObject *run_tokens(PyObject *Py_UNUSED(m), PyObject *args) {
    uint64_t seed, vocab;
    Py_ssize_t start, n;
    if (!parse_run(args, &seed, &start, &n, &vocab)) return NULL;
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = token_obj(token_at(seed, start + k, vocab), vocab);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, t);
    }
    return out;
}

/* span_packed(runs, starts, start, stop, vocab) -> bytes: TokenRuns.packed's whole read in one call. `runs` is a
 * TokenRuns' tuple of (seed, offset, length) and `starts` each run's first position; tokens [start, stop) of the
 * sequence, run by run, packed as native int64s. A context's extension reads its new tokens this way
 * once a turn, and finding the pieces in Python, packing each and joining them was ~1.5% of a 544-GPU run. */
static PyObject *span_packed(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *runs, *starts;
    Py_ssize_t start, stop;
    long long v;
    if (!PyArg_ParseTuple(args, "O!O!nnL", &PyTuple_Type, &runs, &PyList_Type, &starts, &start, &stop, &v)) return NULL;
    if (v < 1) {
        PyErr_SetString(PyExc_ValueError, "vocab must be >= 1");
        return NULL;
    }
    Py_ssize_t nruns = PyTuple_GET_SIZE(runs);
    if (PyList_GET_SIZE(starts) != nruns) {
        PyErr_SetString(PyExc_ValueError, "starts must hold one position per run");
        return NULL;
    }
    if (start < 0) start = 0;
    Py_ssize_t total = 0;
    if (nruns) {
        Py_ssize_t last = PyLong_AsSsize_t(PyList_GET_ITEM(starts, nruns - 1));
        if (last == -1 && PyErr_Occurred()) return NULL;
        PyObject *r = PyTuple_GET_ITEM(runs, nruns - 1);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) goto bad_run;
        Py_ssize_t len = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, 2));
        if (len == -1 && PyErr_Occurred()) return NULL;
        total = last + len;
    }
    if (stop > total) stop = total;
    Py_ssize_t n = stop > start ? stop - start : 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL || n == 0) return out;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    /* the last run starting at or before `start` (bisect_right - 1), then run by run */
    Py_ssize_t lo = 0, hi = nruns;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(starts, mid));
        if (s == -1 && PyErr_Occurred()) goto fail;
        if (start < s) hi = mid;
        else lo = mid + 1;
    }
    Py_ssize_t pos = start, w = 0;
    for (Py_ssize_t k = lo - 1; pos < stop && k < nruns; k++) {
        PyObject *r = PyTuple_GET_ITEM(runs, k);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) {
            Py_DECREF(out);
            goto bad_run;
        }
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(starts, k));
        uint64_t seed = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(r, 0));
        Py_ssize_t off = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, 1));
        Py_ssize_t len = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, 2));
        if (PyErr_Occurred()) goto fail;
        Py_ssize_t end = s + len < stop ? s + len : stop;
        for (Py_ssize_t p = pos; p < end; p++) dst[w++] = (int64_t)token_at(seed, off + p - s, (uint64_t)v);
        if (end > pos) pos = end;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
bad_run:
    PyErr_SetString(PyExc_TypeError, "runs must be (seed, offset, length) tuples");
    return NULL;
}

static PyMethodDef methods[] = {
    {"span_packed", span_packed, METH_VARARGS,
     "span_packed(runs, starts, start, stop, vocab) -> tokens [start, stop) of a TokenRuns' runs, packed as int64s"},
    {"run_tokens", run_tokens, METH_VARARGS,
     "run_tokens(seed, start, stop, vocab) -> tokens [start, stop) of run `seed`: splitmix64 of (seed, position) "
     "modulo vocab"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "llmd.sim._tokens", "The cluster simulator's token runs in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__tokens(void) { return PyModule_Create(&moduledef); }
