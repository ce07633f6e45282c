"""Hostile strings in a spec's slurm, env and name fields: refused with a UserError naming the field, or rendered so
that no value leaves its #SBATCH line or its quotes, for sbatch's own tokenizer and for bash alike (property-based,
bounded to a few seconds)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from launchers.plan import plan_job
from launchers.script import render_plain, render_submitit
from llmd.errors import UserError
from llmd.spec import SpecError, parse_spec, parse_spec_text
from llmd.spec.values import constraint_expression

RUN_DIR = Path("/scratch/it's a run/x-1")
WORKDIR = Path("/home/u/work dir")
PYTHON = "/opt/py thon/bin/python3"

# Pieces that have broken batch scripts: newlines, quotes, command substitution, comments, sbatch's own words.
HOSTILE = [
    "\n", "\r", "\t", "\x00", "\x1b", "\u2028", "'", '"', "\\", "`id`", "$(touch PWNED)", "${X}", "#", ";", "&&",
    " ", "|", "&", "(", ")", "<", ">", "*", "=", ",", ":", "-", "--", "hetjob", "PackJob", "#SBATCH --x", "\u00e9",
]  # fmt: skip
WORD = st.from_regex(r"[A-Za-z0-9_.-]{1,10}", fullmatch=True)
PIECES = st.lists(st.one_of(WORD, st.sampled_from(HOSTILE)), min_size=1, max_size=5).map("".join)
VALUE = st.one_of(WORD, PIECES, st.text(max_size=12))
TIME = st.one_of(st.sampled_from(["01:00:00", "90", "1-12:00", "infinite", "5:30"]), VALUE)
OPTION = st.one_of(
    st.builds(lambda n, v: f"--{n}" + ("" if v is None else f"={v}"), WORD.map(str.lower), st.none() | VALUE),
    VALUE,
)


FIELDS = ("partition", "account", "qos", "time", "constraints", "mem", "container_image", "extra_sbatch", "env", "name")


@st.composite
def specs(draw: st.DrawFn) -> dict:
    # Up to two fields get hostile values, the rest plausible ones, so about half the specs are valid and rendered.
    hostile = draw(st.sets(st.sampled_from(FIELDS), max_size=2))

    def pick(field: str, good: st.SearchStrategy) -> object:
        return draw(st.none() | (VALUE if field in hostile else good))

    options = st.lists(OPTION if "extra_sbatch" in hostile else st.sampled_from(["--exclusive", "--comment=a b #c"]))
    slurm = {
        "partition": pick("partition", st.sampled_from(["gpu", "gpu,cpu", "a.b-c_d"])),
        "account": pick("account", WORD),
        "qos": pick("qos", WORD),
        "time": draw(TIME if "time" in hostile else st.sampled_from(["01:00:00", "90", "1-12:00", "infinite"])),
        "constraints": draw(
            st.lists(VALUE if "constraints" in hostile else st.sampled_from(["h100", "a|b"]), max_size=3)
        ),
        "mem": pick("mem", st.sampled_from(["64G", "0", "500M"])),
        "container_image": pick("container_image", st.sampled_from(["nvcr.io#nvidia/vllm:25.01", "/img/v.sqsh"])),
        "extra_sbatch": draw(options.filter(lambda xs: len(xs) <= 3)),
        "requeue": draw(st.booleans()),
    }
    env = draw(st.dictionaries(VALUE, VALUE, max_size=3) if "env" in hostile else st.just({"HF_HOME": "/a b/c"}))
    name = draw(VALUE if "name" in hostile else st.sampled_from(["run", "a-b_c"]))
    return {"name": name, "slurm": {k: v for k, v in slurm.items() if v is not None}, "engine": {"env": env}}


def sbatch_words(text: str) -> list[str]:
    """The words sbatch reads from the rest of an #SBATCH line (slurm's src/sbatch/opt.c get_argument): quotes of
    either kind group, a backslash escapes anywhere (also inside quotes), an unquoted # starts a comment."""
    words, i, n = [], 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        word: list[str] = []
        quote, escape, comment = "", False, False
        while i < n and (quote or not text[i].isspace()):
            c = text[i]
            i += 1
            if escape:
                escape = False
                word.append(c)
            elif c == "\\":
                escape = True
            elif quote:
                if c == quote:
                    quote = ""
                else:
                    word.append(c)
            elif c in "'\"":
                quote = c
            elif c == "#":
                comment = True
                break
            else:
                word.append(c)
        assert not quote, f"sbatch would stop at an unmatched quote in {text!r}"
        if word:
            words.append("".join(word))
        if comment:
            break
    return words


def expected_header(spec, plan) -> list[list[str]]:
    """What sbatch must read: the job's global options, then each component's options, as word lists per line."""
    s = spec.slurm
    lines = [
        [f"--job-name=llmd-{spec.name}"],
        [f"--chdir={WORKDIR}"],
        [f"--output={RUN_DIR}/logs/batch-%j.out"],
        ["--open-mode=append"],
    ]
    if s.requeue:
        lines.append(["--requeue"])
    for comp in plan.components:
        if comp.index:
            lines.append(["hetjob"])
        lines += [[f"--nodes={comp.nodes}"], ["--ntasks-per-node=1"], [f"--cpus-per-task={s.cpus_per_task}"]]
        lines.append([f"--time={s.time}"])
        if comp.gpus_per_node:
            lines.append([f"--gpus-per-node={comp.gpus_per_node}"])
        for key in ("partition", "account", "qos", "mem"):
            if getattr(s, key) is not None:
                lines.append([f"--{key}={getattr(s, key)}"])
        if s.constraints:
            lines.append([f"--constraint={constraint_expression(s.constraints)}"])
        lines += [[opt] for opt in s.extra_sbatch]
    return lines


def header(script: str) -> list[str]:
    """The lines sbatch scans for options: after the shebang, up to the first line that is a command."""
    lines = script.split("\n")
    assert lines[0] == "#!/bin/bash"
    out = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        out.append(line)
    return out


def bash_syntax_ok(*scripts: str) -> None:
    # One bash for all of them: each is a whole script, so their concatenation parses iff each does.
    bash = subprocess.run(["bash", "-n"], input="\n".join(scripts), capture_output=True, text=True, timeout=30)
    assert bash.returncode == 0, bash.stderr


def check_script(script: str, spec, plan) -> None:
    head = header(script)
    assert all(not line.strip() or line.startswith("#") for line in head)
    sbatch = [line for line in head if line.startswith("#SBATCH")]
    breaks = [line for line in sbatch if "hetjob" in line.lower() or "packjob" in line.lower()]
    assert len(breaks) == len(plan.components) - 1, breaks  # sbatch splits components at these lines only
    read = [sbatch_words(line.removeprefix("#SBATCH")) for line in sbatch]
    want = expected_header(spec, plan)
    if spec.slurm.requeue and "--signal=USR2@90" in script:
        want.insert(4 + 1, ["--signal=USR2@90"])
    assert read == want
    # A shell reads each option line as the same words (so the script means one thing to both readers).
    for line, words in zip(sbatch, read, strict=True):
        assert shlex.split(line.removeprefix("#SBATCH"), comments=True) == words
    # Paths in the body stay single words for bash.
    main = next(line for line in script.split("\n") if line.startswith("srun --het-group=0"))
    assert f"--output={RUN_DIR}/logs/main.log" in shlex.split(main)
    if spec.slurm.container_image:
        assert f"--container-image={spec.slurm.container_image}" in shlex.split(main)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs())
def test_random_slurm_and_env_values_are_refused_or_quoted(data: dict) -> None:
    try:
        spec = parse_spec(data)
    except UserError as exc:
        event("refused")
        assert isinstance(exc, SpecError) and exc.errors
        assert all(issue.path for issue in exc.errors), exc  # each problem names its field
        return
    event("rendered")
    plan = plan_job(spec, RUN_DIR, WORKDIR, gpus=True, starter="basic", python=PYTHON)
    scripts = render_plain(plan), render_submitit(plan)
    bash_syntax_ok(*scripts)
    for script in scripts:
        check_script(script, spec, plan)


INJECTIONS = {
    "extra_sbatch: ['--exclusive\\ntouch PWNED\\n#SBATCH --comment=x']": "slurm.extra_sbatch.0",
    'partition: "gpu\\ntouch PWNED #"': "slurm.partition",
    "extra_sbatch: ['--comment=$(touch PWNED)']": "slurm.extra_sbatch.0",
    "account: 'a;touch PWNED'": "slurm.account",
    "qos: hetjob": "slurm.qos",
    "constraints: ['h100 && touch PWNED']": "slurm.constraints.0",
    "container_image: 'img;touch PWNED'": "slurm.container_image",
    "extra_sbatch: [-N 2]": "slurm.extra_sbatch.0",
}


@pytest.mark.parametrize("line", INJECTIONS)
def test_reported_injections_are_refused_by_field(line: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec_text(f"slurm:\n  {line}\n")
    assert [issue.path for issue in info.value.errors] == [INJECTIONS[line]]


def test_env_names_must_be_shell_names() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec_text("engine:\n  env: {'BAD;NAME': x}\ndecode:\n  env: {OK_1: \"a\\nb\"}\n")
    messages = {issue.path: issue.message for issue in info.value.errors}
    assert "is not an environment variable name" in messages["engine.env.BAD;NAME"]
    assert "holds a newline" in messages["decode.env"]


def test_values_are_quoted_where_sbatch_would_split_them(tmp_path: Path) -> None:
    spec = parse_spec(
        {"slurm": {"extra_sbatch": ["--comment=nightly run #3", "--exclusive"], "constraints": ["a|b", "c"]}}
    )
    script = render_plain(plan_job(spec, RUN_DIR, WORKDIR, gpus=False))
    assert "#SBATCH --comment='nightly run #3'" in script
    assert "#SBATCH --constraint='(a|b)&c'" in script


def test_paths_sbatch_cannot_carry_are_refused() -> None:
    spec = parse_spec({})
    for path, words in (
        (Path("/tmp/a\nb"), "newline"),
        (Path("/tmp/a\\b"), "backslash"),
        (Path("/x/hetjob"), "hetjob"),
    ):
        with pytest.raises(UserError, match=words):
            plan_job(spec, path, WORKDIR, gpus=False)
    with pytest.raises(UserError, match="file name pattern"):
        plan_job(spec, Path("/tmp/100%"), WORKDIR, gpus=False)
