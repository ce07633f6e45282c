/* The cluster simulator's event loop in C: loop.py's EventLoop, the same order and the same clock.
 *
 * Why: at 544 GPUs a simulated second is ~13,000 events, and the Python loop's share of each (a tuple per event,
 * heapq comparing tuples of (time, sequence, ...), the loop's own bytecode) was ~7% of the run. Here an event is a
 * struct in a binary heap ordered by (time, sequence): events at the same time run in the order they were scheduled.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    double t;
    unsigned long long seq;
    PyObject *fn;
    PyObject *args; /* a tuple */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *heap;
    Py_ssize_t n, cap;
    unsigned long long seq;
    double now;
    long long events;
    char stopped;
} Loop;

static inline int before(const Entry *a, const Entry *b) {
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static int push(Loop *self, double t, PyObject *fn, PyObject *const *args, Py_ssize_t nargs) {
    if (self->n == self->cap) {
        Py_ssize_t cap = self->cap ? self->cap * 2 : 1024;
        Entry *h = PyMem_Realloc(self->heap, (size_t)cap * sizeof(Entry));
        if (h == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->heap = h;
        self->cap = cap;
    }
    PyObject *tup = PyTuple_New(nargs);
    if (tup == NULL) return -1;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(tup, i, args[i]);
    }
    Py_INCREF(fn);
    Entry e = {t > self->now ? t : self->now, self->seq++, fn, tup}; /* never in the past (NaN: now, as loop.py) */
    Entry *h = self->heap;
    Py_ssize_t i = self->n++;
    while (i > 0) { /* sift up */
        Py_ssize_t p = (i - 1) >> 1;
        if (!before(&e, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
    return 0;
}

/* Takes the earliest entry out (the heap must not be empty); its references pass to the caller. */
static Entry pop(Loop *self) {
    Entry *h = self->heap;
    Entry top = h[0];
    Entry last = h[--self->n];
    Py_ssize_t n = self->n, i = 0;
    for (;;) { /* sift down */
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && before(&h[c + 1], &h[c])) c++;
        if (!before(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (n) h[i] = last;
    return top;
}

static PyObject *Loop_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "EventLoop() takes no arguments");
        return NULL;
    }
    Loop *self = (Loop *)type->tp_alloc(type, 0);
    return (PyObject *)self; /* zeroed: empty heap, now 0.0, no events, not stopped */
}

static int Loop_traverse(Loop *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Py_VISIT(self->heap[i].fn);
        Py_VISIT(self->heap[i].args);
    }
    return 0;
}

static int Loop_clear(Loop *self) {
    Py_ssize_t n = self->n;
    self->n = 0; /* first: a finalizer that runs below sees an empty heap */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_CLEAR(self->heap[i].fn);
        Py_CLEAR(self->heap[i].args);
    }
    return 0;
}

static void Loop_dealloc(Loop *self) {
    PyObject_GC_UnTrack(self);
    Loop_clear(self);
    PyMem_Free(self->heap);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int as_time(PyObject *obj, double *t) {
    *t = PyFloat_AsDouble(obj);
    return *t == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static PyObject *Loop_at(Loop *self, PyObject *const *args, Py_ssize_t nargs) {
    double t;
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "at(t, fn, *args) needs a time and a callable");
        return NULL;
    }
    if (as_time(args[0], &t) < 0 || push(self, t, args[1], args + 2, nargs - 2) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Loop_after(Loop *self, PyObject *const *args, Py_ssize_t nargs) {
    double dt;
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "after(dt, fn, *args) needs a delay and a callable");
        return NULL;
    }
    if (as_time(args[0], &dt) < 0 || push(self, self->now + dt, args[1], args + 2, nargs - 2) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Loop_run(Loop *self, PyObject *arg) {
    double until;
    if (as_time(arg, &until) < 0) return NULL;
    long long n = 0;
    while (self->n && self->heap[0].t <= until && !self->stopped) {
        Entry e = pop(self);
        self->now = e.t;
        PyObject *r = PyObject_Vectorcall(e.fn, &PyTuple_GET_ITEM(e.args, 0), PyTuple_GET_SIZE(e.args), NULL);
        Py_DECREF(e.fn);
        Py_DECREF(e.args);
        if (r == NULL) return NULL; /* as loop.py: the event is gone, the count of this run not added */
        Py_DECREF(r);
        n++;
    }
    self->events += n;
    /* Not stopped, events left: the next is past `until`, and the clock moves up to it (with none left it stays). */
    if (!self->stopped && self->n && until > self->now) self->now = until;
    return PyBool_FromLong(self->n > 0);
}

static PyObject *Loop_next_time(Loop *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->n) Py_RETURN_NONE;
    return PyFloat_FromDouble(self->heap[0].t);
}

static PyObject *Loop_stop(Loop *self, PyObject *Py_UNUSED(ignored)) {
    self->stopped = 1;
    Py_RETURN_NONE;
}

static Py_ssize_t Loop_len(Loop *self) { return self->n; }

static PyMethodDef Loop_methods[] = {
    {"at", (PyCFunction)(void (*)(void))Loop_at, METH_FASTCALL, "at(t, fn, *args): fn(*args) at time t (now, if t is past)."},
    {"after", (PyCFunction)(void (*)(void))Loop_after, METH_FASTCALL, "after(dt, fn, *args): at(now + dt, ...)."},
    {"run", (PyCFunction)Loop_run, METH_O,
     "run(until): events up to `until` in time order; True when events remain after it (or stop() was called)."},
    {"next_time", (PyCFunction)Loop_next_time, METH_NOARGS, "The earliest pending event's time, None if none."},
    {"stop", (PyCFunction)Loop_stop, METH_NOARGS, "run() returns before its next event."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Loop_members[] = {
    {"now", T_DOUBLE, offsetof(Loop, now), 0, "The loop's time, in simulated seconds."},
    {"events", T_LONGLONG, offsetof(Loop, events), 0, "Events run so far."},
    {"stopped", T_BOOL, offsetof(Loop, stopped), 0, "stop() was called."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods Loop_as_sequence = {.sq_length = (lenfunc)Loop_len};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmd.sim._loop.EventLoop",
    .tp_doc = "The simulator's clock: at(t, fn, *args) schedules, run(until) executes events in (time, order).",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = Loop_new,
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_traverse = (traverseproc)Loop_traverse,
    .tp_clear = (inquiry)Loop_clear,
    .tp_methods = Loop_methods,
    .tp_members = Loop_members,
    .tp_as_sequence = &Loop_as_sequence,
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_loop", "loop.py's EventLoop in C.", -1, NULL};

PyMODINIT_FUNC PyInit__loop(void) {
    if (PyType_Ready(&LoopType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&LoopType);
    if (PyModule_AddObject(m, "EventLoop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(&LoopType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
