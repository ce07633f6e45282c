"""Fuzzing the spec loader (hypothesis, bounded): any text, any types, unknown keys, aliases, anchors, sizes and hostile
strings give a valid spec or a SpecError (a UserError), never another exception and never a hang; the same bounds hold
for every other YAML file llmd reads from users (sweeps, simulator parameters, profile files)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from llmd.errors import UserError
from llmd.spec import DeploymentSpec, SpecError, load_spec, parse_spec_text
from llmd.spec.yaml_input import MAX_ALIAS_NODES, MAX_BYTES

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = (REPO / "examples" / "tiny-local.yaml").read_text()
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
SECONDS = 5.0  # a refusal or a spec, each within this

SECTIONS = {name: DeploymentSpec.model_fields[name].annotation for name in DeploymentSpec.SECTIONS}
KEYS = {name: list(model.model_fields) for name, model in SECTIONS.items()}  # type: ignore[union-attr]

HOSTILE_TEXT = st.sampled_from(
    ["\n", "\x00", "\x1b[2J", "\u2028", "'", '"', "\\", "$(id)", "`id`", "#", "*a", "&a", "hetjob", "--x=y", "é", " "]
)
TEXT = st.one_of(st.text(max_size=16), st.lists(HOSTILE_TEXT, max_size=4).map("".join))
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**40, max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
)
VALUE = st.recursive(
    SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8
)


@st.composite
def documents(draw: st.DrawFn) -> object:
    """Spec-shaped data: known sections and keys with values of any type, plus unknown keys and odd top levels."""
    if draw(st.integers(0, 9)) == 0:
        return draw(VALUE)  # not a mapping at all
    doc: dict[object, object] = {}
    for section in draw(st.sets(st.sampled_from(sorted(SECTIONS)), max_size=4)):
        keys = st.sampled_from(KEYS[section]) | TEXT
        doc[section] = draw(st.dictionaries(keys, VALUE, max_size=4)) if draw(st.booleans()) else draw(VALUE)
    doc.update(draw(st.dictionaries(st.sampled_from(["name", "nmae"]) | TEXT, VALUE, max_size=2)))
    return doc


# Pieces of YAML syntax that have tripped loaders: anchors, aliases, merges, tags, directives, tabs, documents.
SNIPPETS = st.sampled_from(
    [
        "&a ", "*a", "<<: *a\n", "!!python/object/apply:os.system ['id']", "!!binary aGk=", "!!set {a}", "\t",
        ": ", "- ", "{", "}", "[", "]", "---\n", "%YAML 1.1\n", "? [a]\n", "9" * 5000, "2024-13-45", "0x", "0o9",
        "1_000", ".inf", ".nan", "~", "'", '"', "\\", "\n", "\x00", "\ufeff", "\u2028", "|-\n", ">\n", "#",
    ]
)  # fmt: skip


@st.composite
def mutated_examples(draw: st.DrawFn) -> str:
    """The example spec with a few YAML snippets spliced in at random places."""
    text = EXAMPLE
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(SNIPPETS | TEXT) + text[at:]
    return text


def _parse_within_bound(text: str) -> None:
    start = time.monotonic()
    try:
        spec = parse_spec_text(text, "<fuzz>")
    except SpecError as exc:
        assert exc.errors and str(exc)
        event("refused")
    else:
        assert isinstance(spec, DeploymentSpec)
        event("valid")
    assert time.monotonic() - start < SECONDS


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(documents())
def test_any_document_is_a_spec_or_a_spec_error(doc: object) -> None:
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    _parse_within_bound(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_examples())
def test_mangled_yaml_is_a_spec_or_a_spec_error(text: str) -> None:
    _parse_within_bound(text)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 12), st.integers(2, 12))
def test_alias_bombs_are_refused_quickly(width: int, depth: int) -> None:
    lines = ["workload:", "  params:", "    l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for level in range(1, depth):
        lines.append(f"    l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    text = "\n".join(lines) + "\n"
    expanded = sum(width**level for level in range(1, depth + 1))
    start = time.monotonic()
    try:
        parse_spec_text(text, "<bomb>")
    except SpecError as exc:
        if expanded > 2 * MAX_ALIAS_NODES:
            assert "aliases (*name) would expand to more than" in str(exc)
    else:
        assert expanded <= 2 * MAX_ALIAS_NODES + 100  # only small expansions may pass
    assert time.monotonic() - start < SECONDS


def test_self_referencing_alias_is_refused() -> None:
    with pytest.raises(SpecError, match="holds an alias"):
        parse_spec_text("workload:\n  params: &p\n    x: [*p]\n")


def test_merge_keys_and_small_aliases_still_work() -> None:
    spec = parse_spec_text("decode: &pool\n  replicas: 2\n  nodes: 2\nprefill:\n  <<: *pool\n  port: 8100\n")
    assert spec.prefill.replicas == 2 and spec.decode.nodes == 2


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: Path("/dev/zero"), "is a character device, not a spec file"),
        (lambda d: d, "is a directory, not a spec file"),
        (lambda d: (os.mkfifo(d / "fifo.yaml"), d / "fifo.yaml")[1], "is a named pipe"),
        (lambda d: _write(d / "big.yaml", "#" * (MAX_BYTES + 1)), "at most 256 KiB"),
        (lambda d: _write(d / "deep.yaml", "a: " + "[" * 5000 + "]" * 5000), "levels deep"),
        (lambda d: _write(d / "int.yaml", "name: x\nworkload: {seed: " + "9" * 5000 + "}"), "cannot be read"),
        (lambda d: _write(d / "bin.yaml", "name: \xff"), "name"),
    ],
)
def test_files_llmd_will_not_read_are_refused_at_once(tmp_path: Path, make, words: str) -> None:
    path = make(tmp_path)
    start = time.monotonic()
    with pytest.raises(SpecError, match=words):
        load_spec(path)
    assert time.monotonic() - start < SECONDS


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8)
)


def test_every_user_yaml_reader_refuses_the_bomb(tmp_path: Path) -> None:
    from llmd.perf.profile_file import read_entries
    from llmd.sim.params import SimParams
    from sweeps.grid import load_sweep

    bomb = _write(tmp_path / "bomb.yaml", BOMB)
    sweep = _write(tmp_path / "sweep.yaml", "name: s\nbase: bomb.yaml\ngrid: {router.policy: [precise]}\n")
    readers = [
        lambda: load_spec(bomb),
        lambda: load_sweep(bomb),
        lambda: load_sweep(sweep),
        lambda: SimParams.load(bomb),
        lambda: read_entries(bomb, "GPU"),
    ]
    for read in readers:
        start = time.monotonic()
        with pytest.raises(UserError, match=r"would expand to more than"):
            read()
        assert time.monotonic() - start < SECONDS
    for read in (lambda: load_sweep(Path("/dev/zero")), lambda: SimParams.load("/dev/zero")):
        with pytest.raises(UserError, match="character device"):
            read()


@pytest.mark.timeout(60)
def test_cli_spec_check_and_show_answer_a_bomb_at_once(tmp_path: Path) -> None:
    bomb = _write(tmp_path / "bomb.yaml", BOMB)
    for args in (["spec", "check", str(bomb), "/dev/zero"], ["spec", "show", str(bomb)]):
        out = subprocess.run(
            [sys.executable, "-m", "llmd.cli", *args], env=ENV, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 1
        text = out.stdout + out.stderr
        assert "would expand to more than" in text and "Traceback" not in text
