"""Rules for spec strings that reach batch scripts, command lines and environments: no control characters anywhere,
and a strict pattern for each Slurm field, so a value can never become a line or a word of its own in a script.

Each rule raises ValueError with the words the loader shows after the value; pure, no llmd imports.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

# Line and paragraph separators are not Cc but editors and some terminals break lines at them.
_LINE_BREAKS = {"\u2028": "line separator", "\u2029": "paragraph separator"}
_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL byte"}

_NAME = r"[A-Za-z0-9_.-]+"
_PARTITION_RE = re.compile(rf"^{_NAME}(?:,{_NAME})*$")
_ACCOUNT_RE = re.compile(rf"^{_NAME}$")
_FEATURE = r"[A-Za-z0-9_.:=+-]+"
_CONSTRAINT_RE = re.compile(rf"^{_FEATURE}(?:\|{_FEATURE})*$")
_IMAGE_RE = re.compile(r"^[A-Za-z0-9_./:#@+=~-]+$")
_HOST_RE = re.compile(r"^[A-Za-z0-9_.:\[\]-]+$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_RE = re.compile(r"^--(?P<name>[a-z][a-z0-9-]*)(?:=(?P<value>.*))?$", re.DOTALL)
# sbatch reads an #SBATCH line with its own tokenizer, not a shell: quotes and backslashes are its syntax, and `$`
# or backticks are never expanded there, so a value holding them is a mistake either way.
_SBATCH_VALUE_BAD = set("'\"\\`$")


def control_character(text: str) -> str | None:
    """A description of the first control character in `text` (with its position), or None when there is none."""
    for index, char in enumerate(text):
        if char in _LINE_BREAKS:
            return f"a {_LINE_BREAKS[char]} (U+{ord(char):04X}) at character {index + 1}"
        if unicodedata.category(char) == "Cc":
            name = _CONTROL_NAMES.get(char, "a control character")
            return f"{name} (U+{ord(char):04X}) at character {index + 1}"
    return None


def no_control(text: str, where: str = "") -> str:
    found = control_character(text)
    if found:
        raise ValueError(
            f"holds {found}{where}; spec values end up in batch scripts and command lines, so they must be one line "
            "of printable text: remove it"
        )
    return text


def printable(text: str) -> str:
    """`text` with its control characters escaped (\\n, \\u2028), for error messages that quote a value."""
    return "".join(
        char.encode("unicode_escape").decode("ascii")
        if char in _LINE_BREAKS or unicodedata.category(char) == "Cc"
        else char
        for char in text
    )


def no_control_anywhere(value: Any, top: bool = True) -> Any:
    """`no_control` on every string in a value, including nested list items and mapping keys."""
    if isinstance(value, str):
        no_control(value, "" if top else f' of "{printable(value)}"')
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            no_control_anywhere(item, top=False)
    elif isinstance(value, dict):
        for key, item in value.items():
            no_control_anywhere(key, top=False)
            no_control_anywhere(item, top=False)
    return value


def not_a_component_break(value: str) -> str:
    """sbatch starts a new het-job component at any #SBATCH line holding "hetjob" or "packjob", wherever it stands."""
    lowered = value.lower()
    for word in ("hetjob", "packjob"):
        if word in lowered:
            raise ValueError(
                f'holds "{word}", which sbatch reads anywhere in an #SBATCH line as the start of another het-job '
                "component; llmd writes the components itself, so choose another value"
            )
    return value


def partition(value: str) -> str:
    not_a_component_break(no_control(value))
    if not _PARTITION_RE.match(value):
        raise ValueError(
            'is not a Slurm partition name; use letters, digits, "_", "." and "-" (several: comma-separated, '
            'e.g. "gpu,gpu-large")'
        )
    return value


def account(value: str) -> str:
    not_a_component_break(no_control(value))
    if not _ACCOUNT_RE.match(value):
        raise ValueError('is not a Slurm account or QoS name; use letters, digits, "_", "." and "-" (e.g. "proj-42")')
    return value


def constraint(value: str) -> str:
    not_a_component_break(no_control(value))
    if not _CONSTRAINT_RE.match(value):
        raise ValueError(
            'is not a Slurm node feature; use letters, digits, "_", ".", ":", "=", "+" and "-", or features joined '
            'by "|" for either one (e.g. "h100" or "h100|a100"); list entries are all required'
        )
    return value


def container_image(value: str) -> str:
    if not _IMAGE_RE.match(no_control(value)):
        raise ValueError(
            "is not a container image; give a registry reference (nvcr.io#nvidia/vllm:25.01) or a squashfs path, "
            "without spaces, quotes or shell characters"
        )
    return value


def host(value: str) -> str:
    if not _HOST_RE.match(no_control(value)):
        raise ValueError('is not a host name or IP address (e.g. "127.0.0.1", "0.0.0.0" or "login1")')
    return value


def port(value: Any) -> Any:
    """A listening port: an integer from 1 to 65535, or "auto" (any free port); one message for both forms."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535):
        return value
    raise ValueError('is not a port; give a number from 1 to 65535, or "auto" for any free port on the node')


def env_name(value: str) -> str:
    if not ENV_NAME_RE.match(no_control(value)):
        raise ValueError(
            "is not an environment variable name; use letters, digits and '_', not starting with a digit (e.g. HF_HOME)"
        )
    return value


def sbatch_option(value: str) -> str:
    """`--name` or `--name=value`, as on the sbatch command line; the value is quoted where it is rendered."""
    no_control(value)
    match = _SBATCH_RE.match(value)
    if not match:
        if re.match(r"^-[A-Za-z]", value):
            hint = "write the long form, e.g. --nodes=2 rather than -N 2"
        elif value.startswith("--") and re.search(r"\s", value.split("=", 1)[0]):
            hint = 'give the value after "=", e.g. "--comment=nightly", not "--comment nightly"'
        else:
            hint = 'write it as on the sbatch command line, e.g. "--exclusive" or "--comment=nightly"'
        raise ValueError(f"is not an sbatch option (--name or --name=value); {hint}")
    not_a_component_break(value)
    bad = sorted({c for c in match.group("value") or "" if c in _SBATCH_VALUE_BAD})
    if bad:
        shown = " ".join(bad)
        raise ValueError(
            f"has {shown} in its value; #SBATCH lines are read by sbatch, not a shell: nothing is expanded there and "
            "quotes are added by llmd, so write the plain value"
        )
    return value


def split_sbatch_option(option: str) -> tuple[str, str | None]:
    """A validated `--name=value` -> (name, value); `--name` -> (name, None), a bare flag."""
    name, eq, value = option.removeprefix("--").partition("=")
    return name, value if eq else None


def constraint_expression(features: list[str]) -> str:
    """slurm.constraints as one --constraint: every entry required; an entry's "a|b" alternatives kept together."""
    if len(features) == 1:
        return features[0]
    return "&".join(f"({f})" if "|" in f else f for f in features)
