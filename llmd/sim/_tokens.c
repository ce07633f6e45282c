/* The cluster simulator's pseudo-random token runs in C: tokens.py's run_tokens, the same values.
 *
 * Why: agents' contexts and engines' outputs read their tokens on demand (a turn's new tokens to hash, a decode's
 * output), and numpy's fixed cost per call plus its array-to-list conversion made that ~6% of a 544-GPU run. The
 * tokens a context's new blocks hash come packed (run_tokens_packed): the block hasher's C pickle reads them there.
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

/* The same tokens packed as native int64s in a bytes object: what the block hasher's C pickle reads (a context's new
 * tokens are hashed, never looked at one by one: no int object is made for each of the ~1M a simulated second). */
static PyObject *run_tokens_packed(PyObject *Py_UNUSED(m), PyObject *args) {
    uint64_t seed, vocab;
    Py_ssize_t start, n;
    if (!parse_run(args, &seed, &start, &n, &vocab)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) return NULL;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t k = 0; k < n; k++) dst[k] = (int64_t)token_at(seed, start + k, vocab);
    return out;
}

static PyMethodDef methods[] = {
    {"run_tokens", run_tokens, METH_VARARGS,
     "run_tokens(seed, start, stop, vocab) -> tokens [start, stop) of run `seed`: splitmix64 of (seed, position) "
     "modulo vocab"},
    {"run_tokens_packed", run_tokens_packed, METH_VARARGS,
     "run_tokens_packed(seed, start, stop, vocab) -> run_tokens' tokens as native int64s in bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "llmd.sim._tokens", "The cluster simulator's token runs in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__tokens(void) { return PyModule_Create(&moduledef); }
