"""The router's chain bookkeeping in C (llmd/router/scheduling/_chains.c) against its Python (chains.py's py_* and
PyChainSet): every answer, every error and the unit counts' dict, key order included, the same after any sequence of
calls, over chains as the router makes them (a shared system prompt, turns extending turns, forks; short and long)."""

from __future__ import annotations

import gc
import math
import os
import random
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from llmd.router.scheduling import chains
from llmd.router.scheduling.chains import PyChainSet, py_common_prefix, py_held_prefix

try:
    from llmd.router.scheduling import _chains
except ImportError:
    _chains = None
# `make test` sets LLMD_REQUIRE_NATIVE=1: a build that silently failed cannot pass as "skipped".
if _chains is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError(
        "llmd.router.scheduling._chains is not built (pip install -e . compiles llmd/router/scheduling/_chains.c)"
    )
pytestmark = pytest.mark.skipif(_chains is None, reason="llmd.router.scheduling._chains is not built (no C compiler)")


@pytest.fixture
def split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """chains.SHORT_UNITS for the test (its param), read by PyChainSet when used and by the C sets when made (bound
    here too: with LLMD_CHAINS_PURE_PYTHON=1 chains.py does not bind them)."""
    short = getattr(request, "param", chains.SHORT_UNITS)
    monkeypatch.setattr(chains, "SHORT_UNITS", short)
    _chains.split_from(vars(chains))
    return short


def _outcome(f: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """What a call did: its value, or its exception's type and arguments."""
    try:
        return ("ok", f(*args, **kwargs))
    except Exception as e:  # the errors are what is compared
        return ("raised", type(e), e.args)


class _Chains:
    """Chains as the router makes them: prefixes of a few trunks (a system prompt and the sessions growing from it,
    up to `longest` units past it, longer as later turns extend them) with new units after them, as tuples or lists;
    cut at SHORT_UNITS and either side of it, among other places."""

    def __init__(self, rng: random.Random, longest: int, unit: Callable[[random.Random], Any]) -> None:
        self.rng, self.unit = rng, unit
        system = [unit(rng) for _ in range(min(longest // 2, 150))]
        self.trunks = [system + [unit(rng) for _ in range(rng.randrange(0, longest))] for _ in range(3)]
        self.trunks.append([unit(rng) for _ in range(rng.randrange(1, longest))])  # no system prompt

    def make(self) -> Sequence[Any]:
        rng = self.rng
        trunk = rng.choice(self.trunks)
        cut = rng.choice(
            (0, len(trunk), rng.randrange(0, len(trunk) + 1), min(len(trunk), rng.choice((255, 256, 257))))
        )
        c = trunk[:cut] + [self.unit(rng) for _ in range(rng.choice((0, 0, 1, rng.randrange(0, 40))))]
        if c and rng.random() < 0.3:
            trunk.extend(c[cut:])  # a later turn extends this one
        return tuple(c) if rng.random() < 0.5 else c


def _copy(rng: random.Random, c: Sequence[Any]) -> Sequence[Any]:
    """An equal chain, not the same object: the other kind of sequence, or equal ints that are other objects."""
    if rng.random() < 0.5:
        return list(c) if isinstance(c, tuple) else tuple(c)
    return type(c)(int(str(u)) if isinstance(u, int) else u for u in c)


def _drive(rng: random.Random, gen: _Chains, steps: int) -> None:
    """The same calls on a C set and a Python one: every outcome, unit count and truth value equal."""
    native, ref = _chains.ChainSet(), PyChainSet()
    held: list[Sequence[Any]] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.4 or not held:
            c = rng.choice(held) if held and rng.random() < 0.15 else gen.make()  # the same chain twice, at times
            assert _outcome(native.add, c) == _outcome(ref.add, c)
            held.append(c)
        elif r < 0.7:
            c = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.4:
                c = _copy(rng, c)
            assert _outcome(native.remove, c) == _outcome(ref.remove, c)
        elif r < 0.8:
            # Never added: new units, a prefix of one held (its units counted by another's: "removed", and the
            # set is then off, as in Python: later removes may raise KeyError, the same in both), or empty.
            pick = rng.random()
            if pick < 0.4:
                c = gen.make()
            elif pick < 0.9:
                c = rng.choice(held)
                c = c[: rng.randrange(0, len(c) + 1)]
            else:
                c = ()
            assert _outcome(native.remove, c) == _outcome(ref.remove, c)
        else:
            q = rng.choice((gen.make(), rng.choice(held), _copy(rng, rng.choice(held))))
            n = len(q)
            for hi, lo in ((None, 0), (rng.randrange(-2, n + 3), 0), (None, rng.randrange(0, n + 2)),
                           (rng.randrange(0, n + 3), rng.randrange(-2, n + 2))):  # fmt: skip
                assert _outcome(native.longest, q, hi, lo) == _outcome(ref.longest, q, hi, lo), (hi, lo)
            assert _outcome(native.longest, q, lo=1) == _outcome(ref.longest, q, lo=1)
        assert list(native.unit_counts().items()) == list(ref.unit_counts().items())
        assert bool(native) == bool(ref)


@pytest.mark.parametrize("seed", range(4))
def test_chain_set_as_python_at_the_real_split(seed: int, split: int) -> None:
    """Chains of a few units to several hundred past SHORT_UNITS (256): short ones counted per unit, long ones kept."""
    _drive(random.Random(seed), _Chains(random.Random(seed + 100), 700, lambda r: r.getrandbits(64)), 300)


@pytest.mark.parametrize("split", [0, 1, 8, 40], indirect=True)
@pytest.mark.parametrize("seed", range(3))
def test_chain_set_as_python_at_other_splits(seed: int, split: int) -> None:
    """Every chain long (0), empty chains short (1), and splits among the chains' lengths."""
    _drive(random.Random(seed), _Chains(random.Random(seed + 200), 60, lambda r: r.getrandbits(64)), 400)


@pytest.mark.parametrize("split", [8], indirect=True)
def test_chain_set_as_python_for_other_hashables(split: int) -> None:
    """Units need only be hashable: strings, and ints past 64 bits and negative."""
    _drive(random.Random(7), _Chains(random.Random(8), 40, lambda r: f"u{r.getrandbits(40)}"), 300)
    _drive(random.Random(9), _Chains(random.Random(10), 40, lambda r: r.getrandbits(100) - 2**99), 300)


def test_the_split_follows_chains_short_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """A C set splits at chains.SHORT_UNITS as it was when the set was made (tests vary it to reach both kinds)."""
    _chains.split_from(vars(chains))
    monkeypatch.setattr(chains, "SHORT_UNITS", 2)
    cs = _chains.ChainSet()
    monkeypatch.setattr(chains, "SHORT_UNITS", 256)  # read when made, not when used
    cs.add((1, 2))  # long: kept whole
    cs.add((3,))  # short: counted
    assert cs.unit_counts() == {3: 1, 1: 1, 2: 1}
    assert cs.longest([1, 2]) == 2 and cs.remove([1, 2]) and cs.remove([3]) and not cs
    cs = _chains.ChainSet()
    cs.add((1, 2))  # short at 256
    assert cs.remove([1, 2]) and not cs


def test_chains_serves_the_c_ones_unless_told_not_to() -> None:
    """chains.py's public names are the C ones where built, the Python ones with LLMD_CHAINS_PURE_PYTHON=1."""
    pure = os.environ.get("LLMD_CHAINS_PURE_PYTHON") == "1"
    c = (_chains.common_prefix, _chains.held_prefix, _chains.ChainSet)
    assert (chains.common_prefix, chains.held_prefix, chains.ChainSet) == (
        (py_common_prefix, py_held_prefix, PyChainSet) if pure else c
    )


class _Seq(Sequence[int]):
    """A sequence that is neither a list nor a tuple: the C reads it through __getitem__ and iteration, as Python."""

    def __init__(self, items: Sequence[int]) -> None:
        self._items = list(items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        return _Seq(self._items[i]) if isinstance(i, slice) else self._items[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)


@pytest.mark.parametrize("split", [256, 8], indirect=True)
def test_chain_set_as_python_for_other_sequences(split: int) -> None:
    rng = random.Random(11)
    base = [rng.getrandbits(64) for _ in range(300)]
    native, ref = _chains.ChainSet(), PyChainSet()
    made = [_Seq([*base[: rng.randrange(1, 300)], rng.getrandbits(64)]) for _ in range(20)]
    for c in made:
        assert _outcome(native.add, c) == _outcome(ref.add, c)
    for c in made[::2]:
        q = _Seq(c[: rng.randrange(0, len(c) + 1)])
        assert _outcome(native.longest, q) == _outcome(ref.longest, q)
        assert _outcome(native.remove, _Seq(list(c))) == _outcome(ref.remove, _Seq(list(c)))
        assert list(native.unit_counts().items()) == list(ref.unit_counts().items())


def test_common_prefix_as_python() -> None:
    rng = random.Random(3)
    for _ in range(400):
        base = [rng.getrandbits(64) for _ in range(rng.randrange(0, 60))]
        a = base[: rng.randrange(0, len(base) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 5))]
        b = base[: rng.randrange(0, len(base) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 5))]
        a, b = rng.choice((tuple, list))(a), rng.choice((tuple, list))(b)
        want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        # n past the overlap and past a chain's end (IndexError, or not, as Python), n <= 0, every kind of hint
        for n in (min(len(a), len(b)), rng.randrange(-2, max(len(a), len(b)) + 3), 0, -1):
            for hint in (0, want, want + 1, rng.randrange(-2, n + 3), n, n - 1):
                got = _outcome(_chains.common_prefix, a, b, n, hint)
                assert got == _outcome(py_common_prefix, a, b, n, hint), (n, hint)
        n = min(len(a), len(b))
        assert _chains.common_prefix(a, b, n=n, hint=want) == want == py_common_prefix(a, b, n, want)


def test_held_prefix_as_python() -> None:
    rng = random.Random(4)
    for _ in range(300):
        held_chains = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 50))] for _ in range(3)]
        refs: dict[int, int] = {}
        for c in held_chains:
            for u in c:
                refs[u] = refs.get(u, 0) + 1
        c = rng.choice(held_chains)
        chain = rng.choice((tuple, list))([*c[: rng.randrange(0, len(c) + 1)], rng.getrandbits(64)])
        n = len(chain)
        for units in (refs, set(refs), frozenset(refs), list(refs)):
            for lo, hi in ((0, n), (rng.randrange(0, n + 1), n), (0, rng.randrange(-1, n + 3)),
                           (rng.randrange(-n - 2, n + 2), rng.randrange(-n - 2, n + 3))):  # fmt: skip
                got = _outcome(_chains.held_prefix, chain, units, lo, hi)
                assert got == _outcome(py_held_prefix, chain, units, lo, hi), (lo, hi)
    assert _chains.held_prefix(chain=[1, 2], units={1: 1}, lo=0, hi=2) == 1


def test_equal_ints_that_are_other_objects() -> None:
    """Units equal but not identical (ints parsed again, as a request's hashes would be) are the same units."""
    rng = random.Random(5)
    c = tuple(rng.getrandbits(64) for _ in range(300))
    twin = tuple(int(str(u)) for u in c)
    assert all(x is not y for x, y in zip(c, twin, strict=True))
    assert _chains.common_prefix(c, twin, 300) == 300 and _chains.common_prefix(c, twin[:200] + c[200:], 300) == 300
    for short in (c[:100], c):  # counted per unit, kept whole
        cs = _chains.ChainSet()
        cs.add(short)
        assert cs.longest(twin) == len(short) and cs.longest(twin[:50]) == 50
        assert cs.remove(twin[: len(short)]) and not cs and cs.unit_counts() == {}


def test_nan_compares_as_python() -> None:
    """Only ints short-cut on identity: Python's `!=` says a NaN differs from itself, and so does the C."""
    a = [math.nan, 1.0]
    assert _chains.common_prefix(a, a, 2) == py_common_prefix(a, a, 2) == 0


def test_no_references_are_leaked() -> None:
    """Chains and their units have the references they had after sets took them, searched them, gave them back,
    were dropped holding them, and calls failed half-way (KeyError in a remove, a unit that cannot be hashed)."""
    rng = random.Random(6)
    trunk = [rng.getrandbits(64) for _ in range(600)]
    made = [(*trunk[: rng.randrange(1, 600)], rng.getrandbits(64)) for _ in range(40)]
    made += [list(c) for c in made[:10]]
    units = trunk + [c[-1] for c in made]
    odd = (rng.getrandbits(64), made[0][-1])  # its last unit is held, its first is not: KeyError

    def cycle() -> None:
        cs = _chains.ChainSet()
        for c in made:
            cs.add(c)
        for c in made:
            cs.longest(c, None, 0)
            cs.longest(c, len(c) // 2, 3)
        cs.unit_counts()
        with pytest.raises(KeyError):
            cs.remove(odd)
        with pytest.raises(TypeError):
            cs.add((*made[0][:3], []))
        for c in made[::2]:
            assert cs.remove(c)
        for c in made[1::2]:
            assert cs.remove(_copy(rng, c))  # an equal chain: the held one goes
        assert not cs.remove((*made[0][:5], 1))
        _chains.common_prefix(made[0], made[1], min(len(made[0]), len(made[1])), 1)
        _chains.held_prefix(made[0], dict.fromkeys(trunk), 0, len(made[0]))
        for c in made:  # a set dropped with chains in it
            cs.add(c)

    def refs() -> list[int]:
        return [sys.getrefcount(c) for c in made] + [sys.getrefcount(u) for u in units] + [sys.getrefcount(odd)]

    cycle()  # anything made once (interned, cached) is made by now
    gc.collect()
    before = refs()
    for _ in range(3):
        cycle()
    gc.collect()
    assert refs() == before


def test_a_cycle_through_a_set_is_collected() -> None:
    """A set holds its chains: a list chain that holds the set makes a cycle, which the garbage collector breaks."""

    class Chain(list):  # a list subclass takes weak references; its C set is reached through the list's item
        pass

    c = Chain(range(300))
    cs = _chains.ChainSet()
    cs.add(c)
    c.append(cs)
    dead = weakref.ref(c)
    del c, cs
    gc.collect()
    assert dead() is None


def test_wrong_arguments_raise_type_error() -> None:
    cs = _chains.ChainSet()
    for call in (
        lambda: cs.add(5),
        lambda: cs.remove(None),
        lambda: cs.longest(3),
        lambda: cs.longest([1], "x"),
        lambda: cs.longest([1], None, 1.5),
        lambda: cs.longest(),
        lambda: cs.longest([1], nope=2),
        lambda: cs.longest([1], 1, chain=[1]),
        lambda: cs.longest([1], 1, 0, 4),
        lambda: cs.add([[1]]),  # an unhashable unit
        lambda: _chains.ChainSet(1),
        lambda: _chains.common_prefix([1], [1]),
        lambda: _chains.common_prefix([1], [1], "2"),
        lambda: _chains.common_prefix(1, 2, 3),
        lambda: _chains.held_prefix([1, 2], 5, 0, 2),
        lambda: _chains.held_prefix([[1]], {}, 0, 1),
        lambda: _chains.split_from([]),
    ):
        with pytest.raises(TypeError):
            call()
    assert not cs and cs.unit_counts() == {}
    # The same errors as Python where both raise them (beyond TypeError's wording).
    py = PyChainSet()
    for c in ([1, 2, 3], [4, 2, 3]):
        cs.add(c)
        py.add(c)
    assert _outcome(cs.remove, [9, 3]) == _outcome(py.remove, [9, 3])  # KeyError(9): the last unit is held
    assert _outcome(_chains.common_prefix, [1, 2], [1, 3], 5) == _outcome(py_common_prefix, [1, 2], [1, 3], 5)
