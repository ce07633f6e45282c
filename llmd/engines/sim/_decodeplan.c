/* The decode planner's pass over the steps in C: what decode_run.plan_steps does, with the same results.
 *
 * Why: a plan walks up to 64 steps x the batch's requests (MTP draws, block thresholds, KV work), and compiled by mypyc
 * that walk cost ~700 instructions per request and step (tagged ints, list appends, reference counts): at 3,000 agents
 * on 544 GPUs the plans were the largest single part of the simulator's instructions (~19%, callgrind). Here the walk
 * runs on C arrays; only what the run keeps becomes Python objects.
 *
 * steps(ctx, rem, held, next_full, k_spec, bs, max_steps, u, pos, beta, k_lat, mtp, free, silent)
 *   -> (k, gained, events, kv_steps, draws, totals): see plan_steps in decode_run.py, the twin this is held to
 *   (tests/test_decode_plan.py); `u` is UniformStream's buffer of doubles or a list of floats. doubles(raw): the MTP
 *   draws the plans read, made from the generator's words, packed (uniforms._doubles, its twin). line_times(line,
 *   totals): the steps' times on a latency model's decode line (llmd.perf.latency.line_times, its twin).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A list of ints as int64s (new array, or NULL with an exception set). */
static int64_t *int_array(PyObject *list, Py_ssize_t n, const char *what) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != n) {
        PyErr_Format(PyExc_TypeError, "%s must be a list of %zd ints", what, n);
        return NULL;
    }
    int64_t *a = PyMem_Malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (a == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(a);
            return NULL;
        }
        a[i] = v;
    }
    return a;
}

/* Appends a new reference to `list`, dropping it; -1 on error. */
static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* A growable int64 buffer. */
typedef struct {
    int64_t *v;
    Py_ssize_t len, cap;
} Buf;

static int buf_push(Buf *b, int64_t x) {
    if (b->len == b->cap) {
        Py_ssize_t cap = b->cap ? 2 * b->cap : 64;
        int64_t *v = PyMem_Realloc(b->v, sizeof(int64_t) * (size_t)cap);
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->v = v;
        b->cap = cap;
    }
    b->v[b->len++] = x;
    return 0;
}

static PyObject *steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_Format(PyExc_TypeError, "steps() takes 14 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *ctx_o = args[0], *u = args[7];
    if (!PyList_Check(ctx_o)) {
        PyErr_SetString(PyExc_TypeError, "ctx must be a list of ints");
        return NULL;
    }
    /* The draws: UniformStream's buffer of C doubles (read in place), or a list of floats (the Python twin's form). */
    Py_buffer u_view = {0};
    const double *u_d = NULL;
    if (!PyList_Check(u)) {
        if (PyObject_GetBuffer(u, &u_view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 || u_view.itemsize != 8 ||
            u_view.format == NULL || strcmp(u_view.format, "d") != 0) {
            if (u_view.obj != NULL) PyBuffer_Release(&u_view);
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "u must be a list of floats or a buffer of doubles");
            return NULL;
        }
        u_d = (const double *)u_view.buf;
    }
    Py_ssize_t n = PyList_GET_SIZE(ctx_o);
    long long k_spec = PyLong_AsLongLong(args[4]);
    long long bs = PyLong_AsLongLong(args[5]);
    long long max_steps = PyLong_AsLongLong(args[6]);
    Py_ssize_t pos = PyLong_AsSsize_t(args[8]);
    double beta = PyFloat_AsDouble(args[9]);
    long long k_lat = PyLong_AsLongLong(args[10]);
    int mtp = PyObject_IsTrue(args[11]);
    long long free_blocks = PyLong_AsLongLong(args[12]);
    long long silent = PyLong_AsLongLong(args[13]);
    if (PyErr_Occurred() || mtp < 0 || bs < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "block size must be >= 1");
        if (u_d != NULL) PyBuffer_Release(&u_view);
        return NULL;
    }

    PyObject *result = NULL, *gained_o = NULL, *events_o = NULL, *kv_o = NULL, *draws_o = NULL, *totals_o = NULL;
    int64_t *ctx = NULL, *rem = NULL, *held = NULL, *next_full = NULL, *before = NULL;
    Buf gained = {0}, draws = {0};
    double *totals = NULL;
    if (!(ctx = int_array(ctx_o, n, "ctx")) || !(rem = int_array(args[1], n, "rem")) ||
        !(held = int_array(args[2], n, "held")) || !(next_full = int_array(args[3], n, "next_full")))
        goto done;
    before = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    totals = PyMem_Malloc(sizeof(double) * (size_t)(max_steps > 0 ? max_steps : 1));
    if (before == NULL || totals == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!(events_o = PyList_New(0)) || !(kv_o = PyList_New(0))) goto done;

    Py_ssize_t n_u = u_d != NULL ? u_view.len / 8 : PyList_GET_SIZE(u);
    Py_ssize_t p0 = pos;
    long long allocated = 0;
    Py_ssize_t k = 0;
    while (k < max_steps) {
        Py_ssize_t mark = PyList_GET_SIZE(events_o);
        long long alloc = 0;
        int finish = 0, caches = 0;
        int64_t total = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t c = ctx[i] + before[i];
            total += c;
            int64_t d = rem[i] - before[i] - 1;
            if (d > k_spec) d = k_spec;
            int64_t need = c + d; /* slots for the step: its tokens and drafts */
            if (need > held[i] || c >= next_full[i]) {
                if (append_new(events_o, Py_BuildValue("(nnL)", k, i, (long long)(1 + d))) < 0) goto done;
                if (need > held[i]) {
                    int64_t grow = (need - held[i] + bs - 1) / bs;
                    alloc += grow;
                    held[i] += grow * bs;
                }
                if (c >= next_full[i]) {
                    next_full[i] = (c / bs + 1) * bs;
                    caches = 1;
                }
            }
            if (d > 0 && mtp) {
                /* uniforms.accepted: drafts accepted while draws are < beta, up to k_lat; a rejection reads its draw */
                int64_t a = 0;
                while (a < k_lat) {
                    if (pos >= n_u) {
                        PyErr_SetString(PyExc_IndexError, "MTP draws ran out (ahead() showed too few)");
                        goto done;
                    }
                    double x = u_d != NULL ? u_d[pos] : PyFloat_AsDouble(PyList_GET_ITEM(u, pos));
                    if (x == -1.0 && u_d == NULL && PyErr_Occurred()) goto done;
                    pos++;
                    if (x >= beta) break;
                    a++;
                }
                before[i] += (a < d ? a : d) + 1;
            } else {
                before[i] += 1;
            }
            if (before[i] >= rem[i]) {
                finish = 1; /* a step that finishes a request is not planned: single-step it */
                break;
            }
            if (buf_push(&gained, before[i]) < 0) goto done;
        }
        if (finish || allocated + alloc > free_blocks) {
            /* not planned (a finish, or it would preempt): its events and gains are dropped */
            if (PyList_SetSlice(events_o, mark, PyList_GET_SIZE(events_o), NULL) < 0) goto done;
            gained.len = k * n;
            break;
        }
        if (caches || (alloc && allocated + alloc > silent)) {
            if (append_new(kv_o, PyLong_FromSsize_t(k)) < 0) goto done;
        }
        allocated += alloc;
        if (mtp && buf_push(&draws, (int64_t)(pos - p0)) < 0) goto done;
        totals[k] = (double)total;
        k++;
    }

    if (!(gained_o = PyList_New(gained.len)) || !(totals_o = PyList_New(k))) goto done;
    for (Py_ssize_t j = 0; j < gained.len; j++) {
        PyObject *x = PyLong_FromLongLong(gained.v[j]);
        if (x == NULL) goto done;
        PyList_SET_ITEM(gained_o, j, x);
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *x = PyFloat_FromDouble(totals[j]);
        if (x == NULL) goto done;
        PyList_SET_ITEM(totals_o, j, x);
    }
    if (mtp) {
        if (!(draws_o = PyList_New(draws.len))) goto done;
        for (Py_ssize_t j = 0; j < draws.len; j++) {
            PyObject *x = PyLong_FromLongLong(draws.v[j]);
            if (x == NULL) goto done;
            PyList_SET_ITEM(draws_o, j, x);
        }
    } else {
        draws_o = Py_NewRef(Py_None);
    }
    result = Py_BuildValue("(nOOOOO)", k, gained_o, events_o, kv_o, draws_o, totals_o);

done:
    if (u_d != NULL) PyBuffer_Release(&u_view);
    PyMem_Free(ctx);
    PyMem_Free(rem);
    PyMem_Free(held);
    PyMem_Free(next_full);
    PyMem_Free(before);
    PyMem_Free(totals);
    PyMem_Free(gained.v);
    PyMem_Free(draws.v);
    Py_XDECREF(gained_o);
    Py_XDECREF(events_o);
    Py_XDECREF(kv_o);
    Py_XDECREF(draws_o);
    Py_XDECREF(totals_o);
    return result;
}

/* doubles(raw) -> bytes: CPython random()'s doubles from MT19937 words, packed (native doubles), as uniforms.py's
 * _doubles works them out with numpy: each pair (a, b) of raw (a uint64 buffer) gives ((a >> 5) * 2**26 + (b >> 6)) /
 * 2**53. One pass instead of six array operations; packed, because UniformStream keeps its draws as C doubles that the
 * planner (steps) reads in place: a float object a draw, and copying the unread ones at each refill, were ~2% of a
 * 544-GPU run. */
static PyObject *doubles(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (view.itemsize != 8 || view.format == NULL || (strcmp(view.format, "Q") != 0 && strcmp(view.format, "L") != 0 &&
                                                      strcmp(view.format, "<Q") != 0 && strcmp(view.format, "=Q") != 0)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "raw must be a contiguous uint64 buffer");
        return NULL;
    }
    const uint64_t *raw = (const uint64_t *)view.buf;
    Py_ssize_t m = view.len / 16;
    PyObject *out = PyBytes_FromStringAndSize(NULL, m * (Py_ssize_t)sizeof(double));
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    double *d = (double *)PyBytes_AS_STRING(out);
    for (Py_ssize_t j = 0; j < m; j++) {
        double a = (double)(raw[2 * j] >> 5), b = (double)(raw[2 * j + 1] >> 6);
        d[j] = (a * 67108864.0 + b) * (1.0 / 9007199254740992.0);
    }
    PyBuffer_Release(&view);
    return out;
}

/* line_times(line, totals) -> [step time for each total context]: llmd.perf.latency.line_times in C, the same double
 * operations in the same order (setup.py builds this file with -ffp-contract=off: a fused multiply-add would round
 * once where Python rounds twice). `line` is a DecodeLine (a tuple of 14: see latency.py); `totals` a list of floats.
 * Why: the planner prices up to 64 steps a run, and probing the latency model in Python was ~40% of a plan. */
static PyObject *line_times(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "line_times() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *line = args[0], *totals = args[1];
    if (!PyTuple_Check(line) || PyTuple_GET_SIZE(line) != 14) {
        PyErr_SetString(PyExc_TypeError, "line must be a DecodeLine (a tuple of 14)");
        return NULL;
    }
    if (!PyList_Check(totals)) {
        PyErr_SetString(PyExc_TypeError, "totals must be a list of floats");
        return NULL;
    }
    double c[14];
    for (int j = 0; j < 14; j++) {
        c[j] = PyFloat_AsDouble(PyTuple_GET_ITEM(line, j)); /* bools read as 0.0 / 1.0 */
        if (c[j] == -1.0 && PyErr_Occurred()) return NULL;
    }
    const double p1 = c[0], q = c[1], n_half = c[2], a_x = c[3], t1 = c[4], m1 = c[5], m_y = c[6], tk = c[7],
                 draft = c[8], comm0 = c[10], hidden = c[11], overhead = c[13];
    const int has_draft = c[9] != 0.0, has_overlap = c[12] != 0.0;
    Py_ssize_t k = PyList_GET_SIZE(totals);
    PyObject *out = PyList_New(k);
    if (out == NULL) return NULL;
    for (Py_ssize_t s = 0; s < k; s++) {
        double x = PyFloat_AsDouble(PyList_GET_ITEM(totals, s));
        if (x == -1.0 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        double compute = t1 + (p1 + (q * (x + n_half)) * a_x);
        double memory = (m1 + x * m_y) + tk;
        double t = 0.0;
        if (has_draft) {
            compute += draft;
            memory += draft;
        }
        if (compute != 0.0 || memory != 0.0) {
            double busy = compute > memory ? compute : memory;
            double comm = comm0;
            if (has_overlap) comm -= hidden < busy ? hidden : busy;
            t = (busy + comm) + overhead;
        }
        PyObject *v = PyFloat_FromDouble(t);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, s, v);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"steps", (PyCFunction)(void (*)(void))steps, METH_FASTCALL,
     "steps(ctx, rem, held, next_full, k_spec, bs, max_steps, u, pos, beta, k_lat, mtp, free, silent) -> "
     "(k, gained, events, kv_steps, draws, totals): decode_run.plan_steps in C."},
    {"doubles", (PyCFunction)doubles, METH_O,
     "doubles(raw) -> bytes: random()'s doubles from MT19937 words, packed: uniforms._doubles in C."},
    {"line_times", (PyCFunction)(void (*)(void))line_times, METH_FASTCALL,
     "line_times(line, totals) -> each total context's step time: llmd.perf.latency.line_times in C."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "llmd.engines.sim._decodeplan", "The decode planner's pass over the steps, in C.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__decodeplan(void) { return PyModule_Create(&moduledef); }
