/* vLLM's block hash chain with its pickle written in C: llmd/kv/hashing.py's BlockHasher.chain, the same bytes.
 *
 * vLLM hashes a block as H(pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=5)) for the sha256 and
 * xxhash algorithms. For a plain-text block that pickle is fixed in shape: the parent's bytes, a tuple of small ints,
 * None. Writing it straight from the tokens saves the tuple, the Pickler and its memo for every block; the digest
 * itself stays the caller's (hashlib's or xxhash's own function). Tokens come as a list or tuple of ints, or packed as
 * native int64s in bytes (the simulator's token runs, llmd/sim/_tokens.c: no int object a token). The cluster
 * simulator hashes every new block of every agent's context (~16K blocks a simulated second at 544 GPUs), where this
 * was its largest fixed cost.
 *
 * The bytes are CPython's _pickle.c output for that shape (protocol 5): PROTO 5, one FRAME, SHORT_BINBYTES + MEMOIZE,
 * the tuple (MARK ints TUPLE, or TUPLE1/2/3 for up to three) + MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP; ints as BININT1
 * (0..255), BININT2 (..65535) or BININT (the rest of int32). Anything else (a token that is not an exact int in int32
 * range, a parent that is not bytes below 256 long, a frame past pickle's 64 KiB target) returns None: the caller's
 * Python path, which is pickle itself, then hashes it. tests/test_kv_hashing.py holds both to pickle.dumps.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FRAME_TARGET (64 * 1024) /* pickle's _FRAME_SIZE_TARGET: a larger pickle would be framed differently */

/* Tokens' pickled bytes for one block, into out (5 bytes a token at most); -1 where a token does not fit the shape.
 * The tokens are Python ints (items) or native int64s (packed, where items is NULL). */
static Py_ssize_t put_tokens(PyObject **items, const int64_t *packed, Py_ssize_t n, unsigned char *out) {
    unsigned char *p = out;
    if (n > 3) *p++ = '('; /* MARK */
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        if (items != NULL) {
            PyObject *t = items[i];
            if (!PyLong_CheckExact(t)) return -1; /* bool pickles as NEWTRUE/NEWFALSE, subclasses otherwise */
            int overflow = 0;
            v = PyLong_AsLongLongAndOverflow(t, &overflow);
            if (overflow) return -1;
        } else {
            memcpy(&v, packed + i, sizeof v); /* bytes' buffer carries no alignment promise */
        }
        if (v < INT32_MIN || v > INT32_MAX) return -1;
        if (v >= 0 && v <= 0xff) {
            *p++ = 'K';
            *p++ = (unsigned char)v;
        } else if (v >= 0 && v <= 0xffff) {
            *p++ = 'M';
            *p++ = (unsigned char)(v & 0xff);
            *p++ = (unsigned char)(v >> 8);
        } else {
            uint32_t u = (uint32_t)(int32_t)v;
            *p++ = 'J';
            for (int k = 0; k < 4; k++) *p++ = (unsigned char)(u >> (8 * k));
        }
    }
    *p++ = n > 3 ? 't' : (unsigned char)(0x85 + n - 1); /* TUPLE, or TUPLE1..TUPLE3 */
    *p++ = 0x94;                                         /* MEMOIZE */
    return p - out;
}

static PyObject *chain(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *digest, *parent, *tokens;
    Py_ssize_t offset, count, bs;
    if (!PyArg_ParseTuple(args, "OSOnnn", &digest, &parent, &tokens, &offset, &count, &bs)) return NULL;
    PyObject **items = NULL;
    const int64_t *packed = NULL;
    Py_ssize_t have;
    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        items = PySequence_Fast_ITEMS(tokens);
        have = PySequence_Fast_GET_SIZE(tokens);
    } else if (PyBytes_CheckExact(tokens)) {
        if (PyBytes_GET_SIZE(tokens) % (Py_ssize_t)sizeof(int64_t)) {
            PyErr_SetString(PyExc_ValueError, "chain: packed tokens must be whole int64s");
            return NULL;
        }
        packed = (const int64_t *)PyBytes_AS_STRING(tokens);
        have = PyBytes_GET_SIZE(tokens) / (Py_ssize_t)sizeof(int64_t);
    } else {
        Py_RETURN_NONE;
    }
    if (bs < 1 || count < 0 || offset < 0 || offset + count * bs > have) {
        PyErr_SetString(PyExc_ValueError, "chain: blocks past the tokens given");
        return NULL;
    }
    /* Header 2 + frame 9, parent 2 + 255 + 1, tokens (MARK 1 + 5 each + TUPLE 1 + MEMOIZE 1), tail 4. */
    Py_ssize_t cap = 11 + 258 + 3 + 5 * bs + 4;
    if (cap - 11 >= FRAME_TARGET) Py_RETURN_NONE; /* pickle may split a frame from there on */
    unsigned char *buf = PyMem_Malloc((size_t)cap);
    PyObject *out = PyList_New(0);
    if (buf == NULL || out == NULL) {
        PyMem_Free(buf);
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    Py_INCREF(parent);
    PyObject *h = parent;
    for (Py_ssize_t b = 0; b < count; b++) {
        Py_ssize_t plen = PyBytes_GET_SIZE(h);
        if (plen > 255) goto fallback;
        unsigned char *p = buf + 11;
        *p++ = 'C'; /* SHORT_BINBYTES */
        *p++ = (unsigned char)plen;
        memcpy(p, PyBytes_AS_STRING(h), (size_t)plen);
        p += plen;
        *p++ = 0x94; /* MEMOIZE */
        Py_ssize_t at = offset + b * bs;
        Py_ssize_t t = put_tokens(items ? items + at : NULL, packed ? packed + at : NULL, bs, p);
        if (t < 0) goto fallback;
        p += t;
        *p++ = 'N';  /* NONE */
        *p++ = 0x87; /* TUPLE3 */
        *p++ = 0x94; /* MEMOIZE */
        *p++ = '.';  /* STOP */
        uint64_t frame = (uint64_t)(p - (buf + 11));
        buf[0] = 0x80; /* PROTO 5 */
        buf[1] = 5;
        buf[2] = 0x95; /* FRAME, its length little-endian */
        for (int k = 0; k < 8; k++) buf[3 + k] = (unsigned char)(frame >> (8 * k));
        PyObject *data = PyBytes_FromStringAndSize((const char *)buf, p - buf);
        if (data == NULL) goto error;
        PyObject *next = PyObject_CallOneArg(digest, data);
        Py_DECREF(data);
        if (next == NULL) goto error;
        if (!PyBytes_Check(next)) {
            Py_DECREF(next);
            PyErr_SetString(PyExc_TypeError, "chain: the digest function must return bytes");
            goto error;
        }
        if (PyList_Append(out, next) < 0) {
            Py_DECREF(next);
            goto error;
        }
        Py_DECREF(h);
        h = next;
    }
    Py_DECREF(h);
    PyMem_Free(buf);
    return out;
fallback:
    Py_DECREF(h);
    Py_DECREF(out);
    PyMem_Free(buf);
    Py_RETURN_NONE;
error:
    Py_DECREF(h);
    Py_DECREF(out);
    PyMem_Free(buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(digest, parent, tokens, offset, count, block_size) -> the chained hashes of `count` plain-text blocks of "
     "`tokens` (a list or tuple of ints, or native int64s packed in bytes) from `offset`: digest(pickle of (parent, "
     "block tokens, None)) each, or None where the input is not of the shape written here (the caller pickles then)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "llmd.kv._blockpickle", "vLLM's block hash chain with its pickle written in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockpickle(void) { return PyModule_Create(&moduledef); }
