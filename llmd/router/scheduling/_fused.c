/* The scheduling pipeline's scoring pass in C: fused.py's py_pick, the same floats and the same ties (fused.py keeps
 * the Python: the reference this is tested against, tests/test_fused_native.py, and what runs where this is not built).
 *
 * Why: a decision scores every endpoint of a hop with each scorer in use, weights the columns, sums them and picks the
 * highest total. Over numpy that is some twenty array operations per hop, each a few hundred elements of work behind a
 * microsecond of dispatch, allocation and freeing: the scoring passes were ~8% of a 544-GPU simulation's CPU, nearly
 * all of it numpy's overhead. Here it is one loop per scorer over the hop's positions.
 *
 * Every value is computed by the same IEEE operations, in the same order, as fused.py's numpy expressions (no fused
 * multiply-adds: setup.py builds this with -ffp-contract=off), so a decision is the same bit for bit either way.
 * Columns are read through the buffer protocol (1-D, any stride: a column may be a view of a table's column); one of
 * another type or shape is not refused with an error but answered NotImplemented, and the caller scores it in numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The terms a scorer may describe its score by (fused.py's K_* constants, in this order). */
enum { K_CONST, K_PREFIX, K_KVUTIL, K_QUEUE, K_LOAD, K_TOKENLOAD, K_LRU, K_COUNT };

/* picker.TIE_EPS: totals this close to the best are a tie. */
#define TIE_EPS 1e-9

typedef struct {
    Py_buffer view;
    char *p;
    Py_ssize_t stride, n;
    int held; /* view to release */
} Col;

/* Reads `o` as a 1-D column of 8-byte signed ints (want 'i') or doubles ('d'): 1; 0 when it is not one (no error set:
 * the caller answers NotImplemented); -1 on an error. */
static int col_get(PyObject *o, Col *c, char want) {
    c->held = 0;
    if (PyObject_GetBuffer(o, &c->view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_BufferError)) return -1;
        PyErr_Clear();
        return 0;
    }
    c->held = 1;
    const char *f = c->view.format ? c->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = c->view.ndim == 1 && c->view.itemsize == 8 && f[1] == '\0' &&
             (want == 'd' ? f[0] == 'd' : (f[0] == 'l' || f[0] == 'q'));
    if (!ok) return 0;
    c->p = (char *)c->view.buf;
    c->stride = c->view.strides ? c->view.strides[0] : 8;
    c->n = c->view.shape[0];
    return 1;
}

static void col_release(Col *c) {
    if (c->held) PyBuffer_Release(&c->view);
    c->held = 0;
}

static inline int64_t I(const Col *c, Py_ssize_t i) { return *(const int64_t *)(c->p + i * c->stride); }
static inline double D(const Col *c, Py_ssize_t i) { return *(const double *)(c->p + i * c->stride); }

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* How many of used[:m] (ascending) are below s: numpy.searchsorted(used, s), side "left". */
static inline Py_ssize_t lower_bound(const int64_t *used, Py_ssize_t m, int64_t s) {
    Py_ssize_t lo = 0, hi = m;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (used[mid] < s)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* One more than the largest of the positions idx holds (the columns they index must be at least that long), or -1
 * with an IndexError set for a negative one. */
static Py_ssize_t positions_width(const Col *idx) {
    Py_ssize_t width = 0;
    for (Py_ssize_t j = 0; j < idx->n; j++) {
        int64_t i = I(idx, j);
        if (i < 0) {
            PyErr_Format(PyExc_IndexError, "negative position %lld", (long long)i);
            return -1;
        }
        if (i + 1 > width) width = (Py_ssize_t)i + 1;
    }
    return width;
}

#define MAX_COLS 4

/* One term's raw scores at the positions pos[:n] into out[:n]. Returns 1, 0 (a column not readable here: answer
 * NotImplemented), or -1 with an error set. */
static int score_term(PyObject *term, const Py_ssize_t *pos, Py_ssize_t n, Py_ssize_t width, double *out) {
    if (!PyTuple_Check(term) || PyTuple_GET_SIZE(term) < 1) {
        PyErr_SetString(PyExc_TypeError, "a term is a tuple (kind, ...)");
        return -1;
    }
    Py_ssize_t size = PyTuple_GET_SIZE(term);
    long kind = PyLong_AsLong(PyTuple_GET_ITEM(term, 0));
    if (kind == -1 && PyErr_Occurred()) return -1;
    static const Py_ssize_t sizes[K_COUNT] = {2, 6, 2, 2, 3, 5, 3};
    if (kind < 0 || kind >= K_COUNT || size != sizes[kind]) {
        PyErr_Format(PyExc_ValueError, "unknown term kind %ld or wrong arity %zd", kind, size);
        return -1;
    }
    Col c[MAX_COLS];
    int ncols = 0, rc = 1;
    /* The term's columns, in its order; NULL where optional (token-load's hit tokens). */
    static const char *want[K_COUNT] = {"", "ii", "d", "i", "i", "ii", "ii"};
    const char *w = want[kind];
    for (int k = 0; w[k]; k++) {
        PyObject *o = PyTuple_GET_ITEM(term, 1 + k);
        c[k].held = 0;
        c[k].n = -1;
        if (o == Py_None && kind == K_TOKENLOAD && k == 1) {
            ncols = k + 1;
            continue;
        }
        int got = col_get(o, &c[k], w[k]);
        ncols = k + 1;
        if (got <= 0) {
            rc = got;
            goto done;
        }
        /* Positions index the columns (all but the no-hit-LRU's stamps, which its ids index). */
        if (!(kind == K_LRU && k == 0) && c[k].n < width) {
            PyErr_Format(PyExc_IndexError, "a column of %zd values for %zd endpoints", c[k].n, width);
            rc = -1;
            goto done;
        }
    }
    switch (kind) {
    case K_CONST: {
        double v = PyFloat_AsDouble(PyTuple_GET_ITEM(term, 1));
        if (v == -1.0 && PyErr_Occurred()) {
            rc = -1;
            break;
        }
        for (Py_ssize_t j = 0; j < n; j++) out[j] = v;
        break;
    }
    case K_PREFIX: { /* min(1.0, (gpu * gpu_w + cpu * cpu_w) * scale) */
        double gw = PyFloat_AsDouble(PyTuple_GET_ITEM(term, 3));
        double cw = PyFloat_AsDouble(PyTuple_GET_ITEM(term, 4));
        double scale = PyFloat_AsDouble(PyTuple_GET_ITEM(term, 5));
        if (PyErr_Occurred()) {
            rc = -1;
            break;
        }
        for (Py_ssize_t j = 0; j < n; j++) {
            Py_ssize_t i = pos[j];
            double x = ((double)I(&c[0], i) * gw + (double)I(&c[1], i) * cw) * scale;
            out[j] = x < 1.0 ? x : 1.0;
        }
        break;
    }
    case K_KVUTIL: /* free = 1 - usage; free if 0 < free <= 1, 1 above, 0 otherwise (NaN included) */
        for (Py_ssize_t j = 0; j < n; j++) {
            double f = 1.0 - D(&c[0], pos[j]);
            out[j] = f > 0.0 ? (f < 1.0 ? f : 1.0) : 0.0;
        }
        break;
    case K_QUEUE: { /* (hi - q) / (hi - lo) over the positions' queues; 1.0 for all when they are equal */
        if (!n) break;
        int64_t lo = I(&c[0], pos[0]), hi = lo;
        for (Py_ssize_t j = 1; j < n; j++) {
            int64_t q = I(&c[0], pos[j]);
            if (q < lo) lo = q;
            if (q > hi) hi = q;
        }
        if (hi == lo) {
            for (Py_ssize_t j = 0; j < n; j++) out[j] = 1.0;
            break;
        }
        double span = (double)(hi - lo);
        for (Py_ssize_t j = 0; j < n; j++) out[j] = (double)(hi - I(&c[0], pos[j])) / span;
        break;
    }
    case K_LOAD: { /* 0.5 * max(0.0, 1.0 - max(0, waiting) / threshold) */
        long long t = PyLong_AsLongLong(PyTuple_GET_ITEM(term, 2));
        if (t == -1 && PyErr_Occurred()) {
            rc = -1;
            break;
        }
        double td = (double)t;
        for (Py_ssize_t j = 0; j < n; j++) {
            int64_t q = I(&c[0], pos[j]);
            double v = 1.0 - (double)(q > 0 ? q : 0) / td;
            out[j] = 0.5 * (v > 0.0 ? v : 0.0);
        }
        break;
    }
    case K_TOKENLOAD: { /* 1.0 - min(1.0, (max(0, inflight_tokens) + max(0, n - hit_tokens)) / limit) */
        long long need = PyLong_AsLongLong(PyTuple_GET_ITEM(term, 3));
        long long limit = PyLong_AsLongLong(PyTuple_GET_ITEM(term, 4));
        if (PyErr_Occurred()) {
            rc = -1;
            break;
        }
        double ld = (double)limit;
        int hits = c[1].n >= 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            Py_ssize_t i = pos[j];
            int64_t own = hits ? (int64_t)need - I(&c[1], i) : (int64_t)need;
            int64_t it = I(&c[0], i);
            int64_t work = (it > 0 ? it : 0) + (own > 0 ? own : 0);
            double r = (double)work / ld;
            out[j] = 1.0 - (r < 1.0 ? r : 1.0);
        }
        break;
    }
    case K_LRU: { /* never stamped: 1.0; else (m - rank) / (m + 1), the least recent of m stamped highest */
        int64_t *stamps = PyMem_Malloc((n ? n : 1) * 2 * sizeof(int64_t));
        if (stamps == NULL) {
            PyErr_NoMemory();
            rc = -1;
            break;
        }
        int64_t *used = stamps + n;
        Py_ssize_t m = 0, len = c[0].n;
        for (Py_ssize_t j = 0; j < n; j++) {
            int64_t id = I(&c[1], pos[j]);
            if (id < 0) id += len; /* -1: a holder never stamped reads the trailing 0, as numpy's index does */
            if (id < 0 || id >= len) {
                PyErr_Format(PyExc_IndexError, "holder id %lld out of range for %zd stamps", (long long)id, len);
                rc = -1;
                break;
            }
            int64_t s = stamps[j] = I(&c[0], id);
            if (s) used[m++] = s;
        }
        if (rc == 1) {
            qsort(used, m, sizeof(int64_t), cmp_i64);
            double denom = (double)(m + 1);
            for (Py_ssize_t j = 0; j < n; j++) {
                int64_t s = stamps[j];
                out[j] = s == 0 ? 1.0 : (double)(m - lower_bound(used, m, s)) / denom;
            }
        }
        PyMem_Free(stamps);
        break;
    }
    }
done:
    for (int k = 0; k < ncols; k++) col_release(&c[k]);
    return rc;
}

/* pick(idx, terms, weights, totals, scores) -> ties | NotImplemented */
static PyObject *pick(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "pick(idx, terms, weights, totals, scores) takes 5 arguments");
        return NULL;
    }
    PyObject *terms = args[1], *weights = args[2];
    if (!PyTuple_Check(terms) || !PyTuple_Check(weights) || PyTuple_GET_SIZE(terms) != PyTuple_GET_SIZE(weights)) {
        PyErr_SetString(PyExc_TypeError, "terms and weights are tuples of one length");
        return NULL;
    }
    Py_ssize_t nterms = PyTuple_GET_SIZE(terms);
    Col idx;
    int got = col_get(args[0], &idx, 'i');
    if (got <= 0) {
        col_release(&idx);
        if (got < 0) return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    Py_ssize_t n = idx.n;
    Py_buffer tot, sc;
    tot.obj = sc.obj = NULL;
    PyObject *ties = NULL;
    Py_ssize_t *pos = NULL;
    double *col = NULL;
    if (PyObject_GetBuffer(args[3], &tot, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
    if (tot.itemsize != 8 || strcmp(tot.format ? tot.format : "B", "d") != 0 || tot.len < n * 8) {
        PyErr_SetString(PyExc_TypeError, "totals: a writable float64 array of the candidates' length");
        goto fail;
    }
    if (args[4] != Py_None) {
        if (PyObject_GetBuffer(args[4], &sc, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
        if (sc.itemsize != 8 || strcmp(sc.format ? sc.format : "B", "d") != 0 || sc.len < nterms * n * 8) {
            PyErr_SetString(PyExc_TypeError, "scores: a writable float64 array of a row per term");
            goto fail;
        }
    }
    pos = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    col = sc.obj ? NULL : PyMem_Malloc((n ? n : 1) * sizeof(double));
    if (pos == NULL || (sc.obj == NULL && col == NULL)) {
        PyErr_NoMemory();
        goto fail;
    }
    /* The positions, checked once against the narrowest column as each term reads them. */
    Py_ssize_t width = positions_width(&idx);
    if (width < 0) goto fail;
    for (Py_ssize_t j = 0; j < n; j++) pos[j] = (Py_ssize_t)I(&idx, j);
    double *totals = (double *)tot.buf;
    for (Py_ssize_t j = 0; j < n; j++) totals[j] = 0.0;
    for (Py_ssize_t k = 0; k < nterms; k++) {
        double w = PyFloat_AsDouble(PyTuple_GET_ITEM(weights, k));
        if (w == -1.0 && PyErr_Occurred()) goto fail;
        double *out = sc.obj ? (double *)sc.buf + k * n : col;
        int rc = score_term(PyTuple_GET_ITEM(terms, k), pos, n, width, out);
        if (rc < 0) goto fail;
        if (rc == 0) {
            PyMem_Free(pos);
            PyMem_Free(col);
            PyBuffer_Release(&tot);
            if (sc.obj) PyBuffer_Release(&sc);
            col_release(&idx);
            Py_RETURN_NOTIMPLEMENTED;
        }
        for (Py_ssize_t j = 0; j < n; j++) totals[j] = totals[j] + w * out[j];
    }
    ties = PyList_New(0);
    if (ties == NULL) goto fail;
    if (n) {
        double best = totals[0]; /* numpy's max: NaN if any is (then nothing ties, as there) */
        for (Py_ssize_t j = 1; j < n && best == best; j++)
            if (totals[j] > best || totals[j] != totals[j]) best = totals[j];
        double floor = best - TIE_EPS;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (totals[j] >= floor) {
                PyObject *v = PyLong_FromSsize_t(j);
                if (v == NULL || PyList_Append(ties, v) < 0) {
                    Py_XDECREF(v);
                    goto fail;
                }
                Py_DECREF(v);
            }
        }
    }
    PyMem_Free(pos);
    PyMem_Free(col);
    PyBuffer_Release(&tot);
    if (sc.obj) PyBuffer_Release(&sc);
    col_release(&idx);
    return ties;
fail:
    Py_XDECREF(ties);
    PyMem_Free(pos);
    PyMem_Free(col);
    if (tot.obj) PyBuffer_Release(&tot);
    if (sc.obj) PyBuffer_Release(&sc);
    col_release(&idx);
    return NULL;
}

/* Reads args[k] as an int64 column at least `width` long: 1, 0 (not one: NotImplemented), -1 (error set). */
static int col_arg(PyObject *o, Col *c, char want, Py_ssize_t width, const char *name) {
    int got = col_get(o, c, want);
    if (got <= 0) return got;
    if (c->n < width) {
        PyErr_Format(PyExc_IndexError, "%s: %zd values where %zd are read", name, c->n, width);
        return -1;
    }
    return 1;
}

/* Writable C-contiguous int64 buffer of at least `len` items: 0, or -1 with an error set. */
static int out_i64(PyObject *o, Py_buffer *b, Py_ssize_t len, const char *name) {
    if (PyObject_GetBuffer(o, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = b->format ? b->format : "B";
    if (b->itemsize != 8 || !(strcmp(f, "l") == 0 || strcmp(f, "q") == 0) || b->len < len * 8) {
        PyBuffer_Release(b);
        b->obj = NULL;
        PyErr_Format(PyExc_TypeError, "%s: a writable int64 array of at least %zd values", name, len);
        return -1;
    }
    return 0;
}

/* room(idx, inflight, max_inflight, cap, kv_tokens, cached, units, unit, need_tokens, block_size, out) -> (k, f, d)
 * | NotImplemented: fused.py's py_room. */
static PyObject *room(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "room() takes 11 arguments");
        return NULL;
    }
    long long max_inflight = PyLong_AsLongLong(args[2]);
    long long units = PyLong_AsLongLong(args[6]);
    long long unit = PyLong_AsLongLong(args[7]);
    long long need = PyLong_AsLongLong(args[8]);
    long long bs = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    Col idx, inflight, cap, kv, cached;
    idx.held = inflight.held = cap.held = kv.held = cached.held = 0;
    Py_buffer out;
    out.obj = NULL;
    PyObject *res = NULL;
    int got = col_get(args[0], &idx, 'i');
    if (got <= 0) goto unread;
    Py_ssize_t n = idx.n, width = positions_width(&idx);
    if (width < 0) goto fail;
    if ((got = col_arg(args[1], &inflight, 'i', width, "inflight")) <= 0) goto unread;
    if ((got = col_arg(args[3], &cap, 'i', width, "kv_capacity_blocks")) <= 0) goto unread;
    if ((got = col_arg(args[4], &kv, 'i', width, "kv_tokens")) <= 0) goto unread;
    if (args[5] != Py_None && (got = col_arg(args[5], &cached, 'i', width, "cached")) <= 0) goto unread;
    if (out_i64(args[10], &out, 3 * n, "out") < 0) goto fail;
    int64_t *o = (int64_t *)out.buf;
    /* columns.kv_need: blocks are allocated whole, -(-need // bs) * bs with Python's floor division */
    int64_t need_r = need;
    if (bs > 0) {
        int64_t a = -need, q = a / bs;
        if (a % bs != 0 && a < 0) q--;
        need_r = -q * bs;
    }
    Py_ssize_t k = 0, f = 0, d = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = (Py_ssize_t)I(&idx, j);
        int64_t inf = I(&inflight, i);
        if (max_inflight >= 0 && !(inf < max_inflight)) continue;
        o[k++] = i;
        int64_t c = I(&cap, i), t = I(&kv, i);
        int64_t limit = (c - 1) * bs - need_r;
        if (c <= 0 || inf <= 0 || t <= limit) {
            o[n + f++] = i;
        } else if (unit) {
            int64_t most = units;
            if (cached.held) {
                int64_t have = I(&cached, i);
                if (have < most) most = have;
            }
            if (t - most * unit <= limit) { /* in doubt: among the fits, its offset there noted */
                o[2 * n + d++] = f;
                o[n + f++] = i;
            }
        }
    }
    res = Py_BuildValue("(nnn)", k, f, d);
    goto done;
unread:
    if (got < 0) goto fail;
    res = Py_NewRef(Py_NotImplemented);
    goto done;
fail:
    res = NULL;
done:
    if (out.obj) PyBuffer_Release(&out);
    col_release(&idx);
    col_release(&inflight);
    col_release(&cap);
    col_release(&kv);
    col_release(&cached);
    return res;
}

/* hits(blocks_any, blocks_gpu, ids, spec, spec_ids, cap, block_size, out, has) -> True | NotImplemented: fused.py's
 * py_hits. */
static PyObject *hits(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "hits() takes 9 arguments");
        return NULL;
    }
    long long cap = PyLong_AsLongLong(args[5]);
    long long bs = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    Col any, gpu, ids, spec, sids;
    any.held = gpu.held = ids.held = spec.held = sids.held = 0;
    Py_buffer out, has;
    out.obj = has.obj = NULL;
    PyObject *res = NULL;
    int got;
    if ((got = col_get(args[0], &any, 'i')) <= 0) goto unread;
    if ((got = col_get(args[1], &gpu, 'i')) <= 0) goto unread;
    if ((got = col_get(args[2], &ids, 'i')) <= 0) goto unread;
    int speculative = args[3] != Py_None;
    if (speculative) {
        if ((got = col_get(args[3], &spec, 'i')) <= 0) goto unread;
        if ((got = col_arg(args[4], &sids, 'i', ids.n, "spec_ids")) <= 0) goto unread;
    }
    Py_ssize_t m = ids.n;
    if (out_i64(args[7], &out, 5 * m, "out") < 0) goto fail;
    if (PyObject_GetBuffer(args[8], &has, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
    if (has.itemsize != 1 || strcmp(has.format ? has.format : "B", "?") != 0 || has.len < m) {
        PyErr_SetString(PyExc_TypeError, "has: a writable bool array of the endpoints' length");
        goto fail;
    }
    int64_t *o = (int64_t *)out.buf;
    char *h = (char *)has.buf;
    Py_ssize_t nany = any.n < gpu.n ? any.n : gpu.n;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t id = I(&ids, i);
        if (id < 0) id += nany; /* -1: a holder the index does not know reads the trailing 0 */
        if (id < 0 || id >= nany) {
            PyErr_Format(PyExc_IndexError, "holder id %lld out of range", (long long)I(&ids, i));
            goto fail;
        }
        int64_t held = I(&any, id), g = I(&gpu, id);
        char on = held > 0;
        if (speculative) {
            int64_t sid = I(&sids, i);
            if (sid < 0) sid += spec.n;
            if (sid < 0 || sid >= spec.n) {
                PyErr_Format(PyExc_IndexError, "speculative holder id %lld out of range", (long long)I(&sids, i));
                goto fail;
            }
            /* A speculative prefix counts only where it beats the real GPU blocks: at least as long as the real
             * prefix it replaces it, shorter it is the GPU share. */
            int64_t s = I(&spec, sid);
            if (s > g && s > 0) {
                if (s >= held) held = s;
                g = s;
                on = 1;
            }
        }
        int64_t gt = g * bs, ht = held * bs;
        if (gt > cap) gt = cap;
        if (ht > cap) ht = cap;
        o[i] = g;
        o[m + i] = held - g;
        o[2 * m + i] = gt;
        o[3 * m + i] = ht - gt;
        o[4 * m + i] = ht;
        h[i] = on;
    }
    res = Py_NewRef(Py_True);
    goto done;
unread:
    if (got < 0) goto fail;
    res = Py_NewRef(Py_NotImplemented);
    goto done;
fail:
    res = NULL;
done:
    if (out.obj) PyBuffer_Release(&out);
    if (has.obj) PyBuffer_Release(&has);
    col_release(&any);
    col_release(&gpu);
    col_release(&ids);
    col_release(&spec);
    col_release(&sids);
    return res;
}

/* summary(has, gpu, cpu, tokens, idx, gpu_w, cpu_w) -> (first, any, all, same_tokens, best_units, best_weighted,
 * best_tokens) | NotImplemented (no positions, or columns not read here): fused.py's py_summary. */
static PyObject *summary(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "summary() takes 7 arguments");
        return NULL;
    }
    double gw = PyFloat_AsDouble(args[5]), cw = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred()) return NULL;
    Col has, gpu, cpu, tok, idx;
    has.held = gpu.held = cpu.held = tok.held = idx.held = 0;
    PyObject *res = NULL;
    int got;
    if ((got = col_get(args[4], &idx, 'i')) <= 0) goto unread;
    Py_ssize_t n = idx.n, width = positions_width(&idx);
    if (!n) goto unread;
    if (width < 0) goto fail;
    /* has: numpy bools, one byte each */
    if (PyObject_GetBuffer(args[0], &has.view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_BufferError)) goto fail;
        PyErr_Clear();
        goto unread;
    }
    has.held = 1;
    if (has.view.ndim != 1 || has.view.itemsize != 1 || strcmp(has.view.format ? has.view.format : "B", "?") != 0)
        goto unread;
    has.p = (char *)has.view.buf;
    has.stride = has.view.strides ? has.view.strides[0] : 1;
    has.n = has.view.shape[0];
    if (has.n < width) {
        PyErr_Format(PyExc_IndexError, "has: %zd values where %zd are read", has.n, width);
        goto fail;
    }
    if ((got = col_arg(args[1], &gpu, 'i', width, "gpu")) <= 0) goto unread;
    if ((got = col_arg(args[2], &cpu, 'i', width, "cpu")) <= 0) goto unread;
    if ((got = col_arg(args[3], &tok, 'i', width, "tokens")) <= 0) goto unread;
    Py_ssize_t i0 = (Py_ssize_t)I(&idx, 0);
    int first = has.p[i0 * has.stride] != 0, any = 0, all = 1, same = 1, units_seen = 0;
    int64_t t0 = I(&tok, i0), best_units = 0, best_tokens = t0;
    double best_w = 0.0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = (Py_ssize_t)I(&idx, j);
        int h = has.p[i * has.stride] != 0;
        int64_t g = I(&gpu, i), c = I(&cpu, i), t = I(&tok, i);
        if (h) {
            any = 1;
            if (!units_seen || g + c > best_units) best_units = g + c;
            units_seen = 1;
        } else {
            all = 0;
        }
        if (t != t0) same = 0;
        if (t > best_tokens) best_tokens = t;
        double w = (double)g * gw + (double)c * cw;
        if (j == 0)
            best_w = w;
        else if (best_w == best_w && (w > best_w || w != w)) /* numpy's max: a NaN is the answer */
            best_w = w;
    }
    res = Py_BuildValue("(OOOOLdL)", first ? Py_True : Py_False, any ? Py_True : Py_False, all ? Py_True : Py_False,
                        same ? Py_True : Py_False, (long long)best_units, best_w, (long long)best_tokens);
    goto done;
unread:
    if (got < 0) goto fail;
    res = Py_NewRef(Py_NotImplemented);
    goto done;
fail:
    res = NULL;
done:
    col_release(&has);
    col_release(&gpu);
    col_release(&cpu);
    col_release(&tok);
    col_release(&idx);
    return res;
}

static PyMethodDef methods[] = {
    {"pick", (PyCFunction)(void (*)(void))pick, METH_FASTCALL,
     "pick(idx, terms, weights, totals, scores) -> list of tied positions, or NotImplemented: fused.py's py_pick "
     "(totals and, unless None, a row of raw scores per term written in place)"},
    {"room", (PyCFunction)(void (*)(void))room, METH_FASTCALL,
     "room(idx, inflight, max_inflight, kv_capacity_blocks, kv_tokens, cached, units, unit, need_tokens, block_size, "
     "out) -> (k, f, d), or NotImplemented: fused.py's py_room"},
    {"summary", (PyCFunction)(void (*)(void))summary, METH_FASTCALL,
     "summary(has, gpu, cpu, tokens, idx, gpu_w, cpu_w) -> (first, any, all, same_tokens, best_units, best_weighted, "
     "best_tokens), or NotImplemented: fused.py's py_summary"},
    {"hits", (PyCFunction)(void (*)(void))hits, METH_FASTCALL,
     "hits(blocks_any, blocks_gpu, ids, spec, spec_ids, cap, block_size, out, has) -> True, or NotImplemented: "
     "fused.py's py_hits"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_fused", "fused.py's scoring pass in C", -1, methods,
};

PyMODINIT_FUNC PyInit__fused(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "KINDS", K_COUNT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
