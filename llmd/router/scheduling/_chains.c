/* The router's chain bookkeeping in C: chains.py's common_prefix, held_prefix and ChainSet, the same answers, the
 * same errors and, for a set's unit counts, the same dict in the same insertion order (chains.py keeps the Python:
 * the reference this is tested against, tests/test_chains_native.py, and what runs where this is not built).
 *
 * Why: a binary search's few steps and a remove's bisection are a handful of dict lookups or comparisons each, and in
 * Python the interpreter's overhead around them was the cost: ChainSet.remove/longest/add and held_prefix were ~6% of
 * a cluster simulation's CPU.
 *
 * Elements compare as Python's == and != do, in the order chains.py writes them; two references to one int are equal
 * without a call (chains sharing a prefix share the very int objects). Every element is taken as a new reference and
 * every list re-checked for length when read: a user type's __eq__ or __hash__ may run Python code that changes a list
 * under us, and then this raises or answers as Python would, never reads freed memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* chains.SHORT_UNITS: a set made before split_from is called splits here. */
#define DEFAULT_SHORT_UNITS 256

static PyObject *split_ns = NULL;        /* chains.py's globals, where a set reads SHORT_UNITS when made */
static PyObject *str_short_units = NULL; /* "SHORT_UNITS", interned */
static PyObject *one = NULL;             /* 1, a new unit's count */

/* ---- elements ------------------------------------------------------------------------------------------------- */

/* seq[i] as Python's subscript does it (a negative i counts from the end): a new reference, NULL with the error set.
 * Exact lists and tuples directly; anything else through its __getitem__. */
static PyObject *item(PyObject *seq, Py_ssize_t i) {
    if (PyList_CheckExact(seq)) {
        Py_ssize_t n = PyList_GET_SIZE(seq);
        if (i < 0) i += n;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return NULL;
        }
        return Py_NewRef(PyList_GET_ITEM(seq, i));
    }
    if (PyTuple_CheckExact(seq)) {
        Py_ssize_t n = PyTuple_GET_SIZE(seq);
        if (i < 0) i += n;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "tuple index out of range");
            return NULL;
        }
        return Py_NewRef(PyTuple_GET_ITEM(seq, i));
    }
    PyObject *k = PyLong_FromSsize_t(i);
    if (k == NULL) return NULL;
    PyObject *x = PyObject_GetItem(seq, k);
    Py_DECREF(k);
    return x;
}

/* len(seq): -1 with an error set. */
static inline Py_ssize_t length(PyObject *seq) {
    return PyList_CheckExact(seq) || PyTuple_CheckExact(seq) ? Py_SIZE(seq) : PyObject_Size(seq);
}

/* Python's `x == y` (op Py_EQ) or `x != y` (Py_NE) as a truth value: 1, 0, or -1 with an error set. Only exact ints
 * short-cut on identity: an int equals itself, where a float NaN does not. */
static inline int compare(PyObject *x, PyObject *y, int op) {
    if (PyLong_CheckExact(x) && PyLong_CheckExact(y)) {
        int eq = x == y ? 1 : PyObject_RichCompareBool(x, y, Py_EQ); /* ints compare without fail */
        return op == Py_EQ ? eq : !eq;
    }
    PyObject *r = PyObject_RichCompare(x, y, op);
    if (r == NULL) return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* `a[i] == b[j]` or `a[i] != b[j]`: a[i] is fetched first, as Python evaluates it. */
static int items_compare(PyObject *a, Py_ssize_t i, PyObject *b, Py_ssize_t j, int op) {
    PyObject *x = item(a, i);
    if (x == NULL) return -1;
    PyObject *y = item(b, j);
    if (y == NULL) {
        Py_DECREF(x);
        return -1;
    }
    int r = compare(x, y, op);
    Py_DECREF(x);
    Py_DECREF(y);
    return r;
}

/* `chain[i] in units`: an exact dict or set looked up directly, anything else through its __contains__. */
static int unit_in(PyObject *chain, Py_ssize_t i, PyObject *units) {
    PyObject *x = item(chain, i);
    if (x == NULL) return -1;
    int r;
    if (PyDict_CheckExact(units))
        r = PyDict_Contains(units, x);
    else if (PyAnySet_CheckExact(units))
        r = PySet_Contains(units, x);
    else
        r = PySequence_Contains(units, x);
    Py_DECREF(x);
    return r;
}

/* An int argument as Python code would use it in comparisons and indexing (anything with __index__); out of range of
 * Py_ssize_t it clamps, where the Python's indexing then raises IndexError as it would. -1 with an error set. */
static int as_index(PyObject *o, Py_ssize_t *out) {
    Py_ssize_t v = PyNumber_AsSsize_t(o, NULL);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* ---- common_prefix and held_prefix ---------------------------------------------------------------------------- */

/* chains.common_prefix: how many leading units of a[:n] and b[:n] agree; -1 with an error set. The hint is a C
 * integer, or an argument read only where Python's would be (hint_arg, when not NULL). */
static Py_ssize_t prefix(PyObject *a, PyObject *b, Py_ssize_t n, Py_ssize_t hint, PyObject *hint_arg) {
    if (n <= 0) return 0;
    int r = items_compare(a, 0, b, 0, Py_NE);
    if (r) return r < 0 ? -1 : 0;
    r = items_compare(a, n - 1, b, n - 1, Py_EQ);
    if (r) return r < 0 ? -1 : n;
    if (hint_arg != NULL && as_index(hint_arg, &hint) < 0) return -1;
    if (0 < hint && hint < n) {
        r = items_compare(a, hint - 1, b, hint - 1, Py_EQ);
        if (r < 0) return -1;
        if (r) {
            r = items_compare(a, hint, b, hint, Py_NE);
            if (r) return r < 0 ? -1 : hint;
        }
    }
    Py_ssize_t lo = 1, hi = n - 1; /* a[:lo] == b[:lo]; they differ before n */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo + 1) / 2; /* (lo + hi + 1) // 2, both positive */
        r = items_compare(a, mid - 1, b, mid - 1, Py_EQ);
        if (r < 0) return -1;
        if (r)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* chains.held_prefix into *out: 0, or -1 with an error set. lo may be negative (Python indexes from the end then), so
 * the answer and the error are apart. */
static int held(PyObject *chain, PyObject *units, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t *out) {
    *out = lo;
    if (lo >= hi) return 0;
    int r = unit_in(chain, lo, units);
    if (r <= 0) return r;
    lo += 1;
    while (lo < hi) {
        /* (lo + hi + 1) // 2 with Python's floor for a negative lo, and no overflow */
        Py_ssize_t mid = lo + (Py_ssize_t)(((size_t)hi - (size_t)lo + 1) / 2);
        r = unit_in(chain, mid - 1, units);
        if (r < 0) return -1;
        if (r)
            lo = mid;
        else
            hi = mid - 1;
    }
    *out = lo;
    return 0;
}

/* Python's binding of a call's arguments to `names` (the first `required` of them required): out[k] borrowed, NULL
 * where not given. 0, or -1 with a TypeError set. */
static int bind_args(const char *fn, const char *const *names, Py_ssize_t nnames, Py_ssize_t required,
                     PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **out) {
    if (nargs > nnames) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd positional arguments (%zd given)", fn, nnames, nargs);
        return -1;
    }
    for (Py_ssize_t k = 0; k < nnames; k++) out[k] = k < nargs ? args[k] : NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        Py_ssize_t k = 0;
        while (k < nnames && PyUnicode_CompareWithASCIIString(name, names[k]) != 0) k++;
        if (k == nnames) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn, name);
            return -1;
        }
        if (out[k] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, names[k]);
            return -1;
        }
        out[k] = args[nargs + j];
    }
    for (Py_ssize_t k = 0; k < required; k++) {
        if (out[k] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[k]);
            return -1;
        }
    }
    return 0;
}

static PyObject *common_prefix(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"a", "b", "n", "hint"};
    PyObject *a[4];
    Py_ssize_t n;
    if (bind_args("common_prefix", names, 4, 3, args, nargs, kwnames, a) < 0 || as_index(a[2], &n) < 0) return NULL;
    Py_ssize_t got = prefix(a[0], a[1], n, 0, a[3]);
    return got < 0 ? NULL : PyLong_FromSsize_t(got);
}

static PyObject *held_prefix(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"chain", "units", "lo", "hi"};
    PyObject *a[4];
    Py_ssize_t lo, hi, got;
    if (bind_args("held_prefix", names, 4, 4, args, nargs, kwnames, a) < 0 || as_index(a[2], &lo) < 0 ||
        as_index(a[3], &hi) < 0 || held(a[0], a[1], lo, hi, &got) < 0)
        return NULL;
    return PyLong_FromSsize_t(got);
}

/* ---- ChainSet -------------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *refs;   /* dict: unit -> short chains having it; chains.py's _refs, the same keys in the same order */
    PyObject *chains; /* list: the long chains themselves; chains.py's _long, in the same order */
    Py_ssize_t split; /* SHORT_UNITS when the set was made: shorter chains are counted per unit */
} ChainSet;

static PyTypeObject ChainSetType;

static void key_error(PyObject *key) {
    PyObject *t = PyTuple_Pack(1, key); /* KeyError(key), as dict's [] raises it (a tuple key stays one argument) */
    if (t != NULL) {
        PyErr_SetObject(PyExc_KeyError, t);
        Py_DECREF(t);
    }
}

/* refs[key] as a C integer (every count in refs is an int this module made): 0, or -1 with KeyError or an error. */
static int count_of(PyObject *refs, PyObject *key, Py_ssize_t *out) {
    PyObject *v = PyDict_GetItemWithError(refs, key);
    if (v == NULL) {
        if (!PyErr_Occurred()) key_error(key);
        return -1;
    }
    *out = PyLong_AsSsize_t(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* refs[key] = count (replacing a value keeps the key's place, as Python's does). */
static int set_count(PyObject *refs, PyObject *key, Py_ssize_t count) {
    PyObject *v = PyLong_FromSsize_t(count);
    if (v == NULL) return -1;
    int r = PyDict_SetItem(refs, key, v);
    Py_DECREF(v);
    return r;
}

/* collections._count_elements(refs, [key]): refs[key] += 1, a missing key added at the end with 1. A new key costs
 * one lookup (setdefault, told by the dict's growth), where get-then-set is two. */
static int count_one(PyObject *refs, PyObject *key) {
    Py_ssize_t size = PyDict_GET_SIZE(refs);
    PyObject *old = PyDict_SetDefault(refs, key, one);
    if (old == NULL) return -1;
    if (PyDict_GET_SIZE(refs) != size) return 0; /* it was missing: now 1 */
    Py_ssize_t v = PyLong_AsSsize_t(old);
    if (v == -1 && PyErr_Occurred()) return -1;
    return set_count(refs, key, v + 1);
}

/* collections._count_elements(refs, chain): each unit in chain order. */
static int count_chain(PyObject *refs, PyObject *chain) {
    if (PyList_CheckExact(chain) || PyTuple_CheckExact(chain)) {
        for (Py_ssize_t i = 0; i < Py_SIZE(chain); i++) { /* re-read: a unit's __hash__ may change a list */
            PyObject *key = Py_NewRef(PySequence_Fast_GET_ITEM(chain, i));
            int r = count_one(refs, key);
            Py_DECREF(key);
            if (r < 0) return -1;
        }
        return 0;
    }
    PyObject *it = PyObject_GetIter(chain);
    if (it == NULL) return -1;
    PyObject *key;
    while ((key = PyIter_Next(it)) != NULL) {
        int r = count_one(refs, key);
        Py_DECREF(key);
        if (r < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static ChainSet *chainset_make(PyTypeObject *type) {
    Py_ssize_t split = DEFAULT_SHORT_UNITS;
    if (split_ns != NULL) {
        PyObject *v = PyDict_GetItemWithError(split_ns, str_short_units);
        if (v == NULL && PyErr_Occurred()) return NULL;
        if (v != NULL && as_index(v, &split) < 0) return NULL;
    }
    ChainSet *self = (ChainSet *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->split = split;
    self->refs = PyDict_New();
    self->chains = PyList_New(0);
    if (self->refs == NULL || self->chains == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return self;
}

static PyObject *ChainSet_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "ChainSet() takes no arguments");
        return NULL;
    }
    return (PyObject *)chainset_make(type);
}

/* ChainSet() without building an argument tuple: one is made per endpoint, and one for each _distinct_blocks call. */
static PyObject *ChainSet_vectorcall(PyObject *type, PyObject *const *Py_UNUSED(args), size_t nargsf,
                                     PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "ChainSet() takes no arguments");
        return NULL;
    }
    return (PyObject *)chainset_make((PyTypeObject *)type);
}

static int ChainSet_traverse(ChainSet *self, visitproc visit, void *arg) {
    Py_VISIT(self->refs);
    Py_VISIT(self->chains);
    return 0;
}

/* Breaks a cycle through the set (a list chain holding its own set) by emptying it: the dict and list stay, so no
 * method ever meets a NULL. */
static int ChainSet_clear(ChainSet *self) {
    if (self->refs != NULL) PyDict_Clear(self->refs);
    if (self->chains != NULL && PyList_SetSlice(self->chains, 0, PY_SSIZE_T_MAX, NULL) < 0) PyErr_Clear();
    return 0;
}

static void ChainSet_dealloc(ChainSet *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->refs);
    Py_CLEAR(self->chains);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ChainSet_bool(ChainSet *self) {
    return PyDict_GET_SIZE(self->refs) > 0 || PyList_GET_SIZE(self->chains) > 0;
}

static PyObject *ChainSet_add(ChainSet *self, PyObject *chain) {
    Py_ssize_t n = length(chain);
    if (n < 0) return NULL;
    if (n < self->split ? count_chain(self->refs, chain) < 0 : PyList_Append(self->chains, chain) < 0) return NULL;
    Py_RETURN_NONE;
}

/* refs.pop(u) for u in islice(chain, p, n): the tail of units only this chain has. KeyError(u) where one is missing,
 * as pop raises it. */
static int pop_tail(PyObject *refs, PyObject *chain, Py_ssize_t p, Py_ssize_t n) {
    int r = 0;
    if (PyList_CheckExact(chain) || PyTuple_CheckExact(chain)) {
        for (Py_ssize_t i = p; r == 0 && i < n && i < Py_SIZE(chain); i++) { /* islice ends where a list does */
            PyObject *key = Py_NewRef(PySequence_Fast_GET_ITEM(chain, i));
            r = PyDict_DelItem(refs, key);
            Py_DECREF(key);
        }
        return r;
    }
    PyObject *it = PyObject_GetIter(chain), *key;
    if (it == NULL) return -1;
    for (Py_ssize_t i = 0; r == 0 && i < n && (key = PyIter_Next(it)) != NULL; i++) {
        if (i >= p) r = PyDict_DelItem(refs, key);
        Py_DECREF(key);
    }
    Py_DECREF(it);
    return r < 0 || PyErr_Occurred() ? -1 : 0;
}

/* refs[u] -= 1 for u in chain[:p], each read just before it is written (chains.py's refs.update over a zip): the
 * head the chain shares with others. A list's head is a copy, as the slice is. */
static int drop_head(PyObject *refs, PyObject *chain, Py_ssize_t p) {
    if (p <= 0) return 0;
    PyObject *head;
    if (PyTuple_CheckExact(chain)) {
        head = Py_NewRef(chain); /* immutable: its first p units are the slice's */
    } else if (PyList_CheckExact(chain)) {
        head = PyList_GetSlice(chain, 0, p);
    } else {
        PyObject *stop = PyLong_FromSsize_t(p), *slice = stop == NULL ? NULL : PySlice_New(NULL, stop, NULL);
        Py_XDECREF(stop);
        PyObject *part = slice == NULL ? NULL : PyObject_GetItem(chain, slice);
        Py_XDECREF(slice);
        head = part == NULL ? NULL : PySequence_Fast(part, "a chain's slice must be iterable");
        Py_XDECREF(part);
    }
    if (head == NULL) return -1;
    Py_ssize_t m = PyTuple_CheckExact(chain) ? p : PySequence_Fast_GET_SIZE(head);
    int r = 0;
    for (Py_ssize_t i = 0; r == 0 && i < m; i++) {
        PyObject *key = Py_NewRef(PySequence_Fast_GET_ITEM(head, i));
        Py_ssize_t count;
        r = count_of(refs, key, &count);
        if (r == 0) r = set_count(refs, key, count - 1);
        Py_DECREF(key);
    }
    Py_DECREF(head);
    return r;
}

/* remove for a short chain of n > 0 units: 1 removed, 0 certainly none, -1 an error (KeyError where chains.py's
 * dict operations raise it, after the same changes). The same dict operations in the same order as chains.py's. */
static int remove_short(PyObject *refs, PyObject *chain, Py_ssize_t n) {
    PyObject *key = item(chain, -1);
    if (key == NULL) return -1;
    PyObject *last = PyDict_GetItemWithError(refs, key);
    Py_DECREF(key);
    if (last == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_ssize_t count = PyLong_AsSsize_t(last), p;
    if (count == -1 && PyErr_Occurred()) return -1;
    if (count > 1) {
        p = n;
    } else {
        if ((key = item(chain, 0)) == NULL) return -1;
        int r = count_of(refs, key, &count);
        Py_DECREF(key);
        if (r < 0) return -1;
        if (count == 1) {
            p = 0;
        } else {
            Py_ssize_t lo = 0; /* refs[chain[lo]] > 1, refs[chain[p]] == 1 */
            p = n - 1;
            while (p - lo > 1) {
                Py_ssize_t mid = (lo + p) / 2;
                if ((key = item(chain, mid)) == NULL) return -1;
                r = count_of(refs, key, &count);
                Py_DECREF(key);
                if (r < 0) return -1;
                if (count > 1)
                    lo = mid;
                else
                    p = mid;
            }
        }
    }
    return (p < n && pop_tail(refs, chain, p, n) < 0) || drop_head(refs, chain, p) < 0 ? -1 : 1;
}

/* remove for a long chain: the very object first, else one of equal length agreeing end to end (a chain's last unit
 * names the rest); the last chain takes its place. 1, 0 or -1 as remove_short. */
static int remove_long(PyObject *chains, PyObject *chain, Py_ssize_t n) {
    Py_ssize_t at = -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(chains); i++) {
        if (PyList_GET_ITEM(chains, i) == chain) {
            at = i;
            break;
        }
    }
    for (Py_ssize_t i = 0; at < 0 && i < PyList_GET_SIZE(chains); i++) {
        PyObject *c = Py_NewRef(PyList_GET_ITEM(chains, i));
        Py_ssize_t m = length(c), got = 0;
        if (m == n) got = prefix(chain, c, n, 0, NULL);
        Py_DECREF(c);
        if (m < 0 || got < 0) return -1;
        if (m == n && got == n) at = i;
    }
    if (at < 0) return 0;
    Py_ssize_t size = PyList_GET_SIZE(chains);
    if (size == 0) { /* only if a comparison emptied the list: Python's chains[-1] raises here */
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return -1;
    }
    /* chains[at] = chains[-1]; chains.pop() (SetItem takes the reference, and raises as Python where at is past) */
    if (PyList_SetItem(chains, at, Py_NewRef(PyList_GET_ITEM(chains, size - 1))) < 0) return -1;
    size = PyList_GET_SIZE(chains); /* dropping the old chain may have run Python code */
    if (size == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from empty list");
        return -1;
    }
    return PyList_SetSlice(chains, size - 1, size, NULL) < 0 ? -1 : 1;
}

static PyObject *ChainSet_remove(ChainSet *self, PyObject *chain) {
    Py_ssize_t n = length(chain);
    if (n < 0) return NULL;
    int r = n < self->split ? (n ? remove_short(self->refs, chain, n) : 1) : remove_long(self->chains, chain, n);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyObject *ChainSet_unit_counts(ChainSet *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *refs = PyDict_Copy(self->refs);
    if (refs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(self->chains); i++) {
        PyObject *c = Py_NewRef(PyList_GET_ITEM(self->chains, i));
        int r = count_chain(refs, c);
        Py_DECREF(c);
        if (r < 0) {
            Py_DECREF(refs);
            return NULL;
        }
    }
    return refs;
}

static PyObject *ChainSet_longest(ChainSet *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"chain", "hi", "lo"};
    PyObject *a[3];
    if (bind_args("longest", names, 3, 1, args, nargs, kwnames, a) < 0) return NULL;
    PyObject *chain = a[0];
    Py_ssize_t n = length(chain), hi, best = 0;
    if (n < 0) return NULL;
    if (a[1] == NULL || a[1] == Py_None) {
        hi = n;
    } else {
        if (as_index(a[1], &hi) < 0) return NULL;
        if (hi > n) hi = n;
    }
    if (a[2] != NULL && as_index(a[2], &best) < 0) return NULL;
    if (best >= hi) return PyLong_FromSsize_t(best);
    if (PyDict_GET_SIZE(self->refs)) { /* a short chain has < split units (split >= 1 where refs has any) */
        Py_ssize_t cap = self->split - 1;
        if (held(chain, self->refs, best, hi < cap ? hi : cap, &best) < 0) return NULL;
    }
    Py_ssize_t got = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(self->chains); i++) {
        PyObject *c = Py_NewRef(PyList_GET_ITEM(self->chains, i));
        Py_ssize_t m = length(c);
        if (m < 0) goto fail;
        if (m > hi) m = hi;
        if (m > best) {
            int r = items_compare(c, best, chain, best, Py_EQ); /* agrees past what is known: worth a search */
            if (r < 0) goto fail;
            if (r) {
                if ((got = prefix(chain, c, m, got, NULL)) < 0) goto fail;
                if (got > best) {
                    best = got;
                    if (best >= hi) {
                        Py_DECREF(c);
                        break;
                    }
                }
            }
        }
        Py_DECREF(c);
        continue;
    fail:
        Py_DECREF(c);
        return NULL;
    }
    return PyLong_FromSsize_t(best);
}

static PyMethodDef ChainSet_methods[] = {
    {"add", (PyCFunction)ChainSet_add, METH_O, "add(chain): one more chain in the multiset"},
    {"remove", (PyCFunction)ChainSet_remove, METH_O,
     "remove(chain) -> bool: take away one chain equal to `chain`, one the caller added; False (and nothing "
     "changes) where there is certainly none"},
    {"unit_counts", (PyCFunction)ChainSet_unit_counts, METH_NOARGS,
     "unit_counts() -> dict: each unit's count over the chains (a copy)"},
    {"longest", (PyCFunction)(void (*)(void))ChainSet_longest, METH_FASTCALL | METH_KEYWORDS,
     "longest(chain, hi=None, lo=0) -> int: the longest prefix of chain[:hi] one of the chains has, or `lo` if "
     "that is more"},
    {NULL, NULL, 0, NULL},
};

static PyNumberMethods ChainSet_as_number = {.nb_bool = (inquiry)ChainSet_bool};

static PyTypeObject ChainSetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmd.router.scheduling._chains.ChainSet",
    .tp_basicsize = sizeof(ChainSet),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A multiset of chains (chained hashes, each naming every unit before it): chains.py's ChainSet in C",
    .tp_new = ChainSet_new,
    .tp_vectorcall = ChainSet_vectorcall,
    .tp_dealloc = (destructor)ChainSet_dealloc,
    .tp_traverse = (traverseproc)ChainSet_traverse,
    .tp_clear = (inquiry)ChainSet_clear,
    .tp_methods = ChainSet_methods,
    .tp_as_number = &ChainSet_as_number,
};

/* ---- module ---------------------------------------------------------------------------------------------------- */

static PyObject *split_from(PyObject *Py_UNUSED(m), PyObject *ns) {
    if (!PyDict_Check(ns)) {
        PyErr_SetString(PyExc_TypeError, "split_from() takes a dict (a module's globals)");
        return NULL;
    }
    Py_XSETREF(split_ns, Py_NewRef(ns));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"common_prefix", (PyCFunction)(void (*)(void))common_prefix, METH_FASTCALL | METH_KEYWORDS,
     "common_prefix(a, b, n, hint=0) -> int: how many leading units of a[:n] and b[:n] agree"},
    {"held_prefix", (PyCFunction)(void (*)(void))held_prefix, METH_FASTCALL | METH_KEYWORDS,
     "held_prefix(chain, units, lo, hi) -> int: how many leading units of chain[:hi] are in `units`, given that "
     "chain[:lo] are"},
    {"split_from", split_from, METH_O,
     "split_from(namespace): sets made from now on read their split, SHORT_UNITS, from this dict when made (chains.py "
     "passes its globals, so that a test varying chains.SHORT_UNITS varies these sets' too); 256 until then"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_chains", "chains.py's common_prefix, held_prefix and ChainSet in C", -1, methods,
};

PyMODINIT_FUNC PyInit__chains(void) {
    if (PyType_Ready(&ChainSetType) < 0) return NULL;
    if (str_short_units == NULL && (str_short_units = PyUnicode_InternFromString("SHORT_UNITS")) == NULL) return NULL;
    if (one == NULL && (one = PyLong_FromLong(1)) == NULL) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&ChainSetType);
    if (PyModule_AddObject(m, "ChainSet", (PyObject *)&ChainSetType) < 0) {
        Py_DECREF(&ChainSetType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
