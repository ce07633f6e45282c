"""Secrets a spec can carry (a token in an env map, --api-key among an engine's extra_args, a password in a URL)
replaced by *** wherever a spec or a message is recorded: HDF5 metadata, run.json, logs. The run folder's own
spec.yaml keeps them, since the job needs them, and is made private instead (launchers.prepare).

Pure: names and values are judged by their words alone, so one rule serves YAML text, parsed data and log lines.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"

# Last words that make a key a secret (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, db_password, apiKey).
_SECRET_WORDS = {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS", "AUTHORIZATION"}
_SECRET_PAIRS = {("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY"), ("SECRET", "KEY"), ("AUTH", "TOKEN")}
_WORD_RE = re.compile(r"[A-Z]+[0-9]*(?![a-z])|[A-Z]?[a-z]+[0-9]*|[0-9]+")

# Values that are credentials whatever their key: well-known token shapes, bearer headers, passwords in URLs.
_TOKEN_RE = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
)
_BEARER_RE = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
_URL_PASSWORD_RE = re.compile(r"(://[^/\s:@]+:)[^/\s@]+@")
# `--api-key=VALUE`, `--hf-token VALUE`, `HF_TOKEN=VALUE` inside a string (a command line in a log).
_ASSIGNMENT_RE = re.compile(r"(?P<name>--?[A-Za-z][A-Za-z0-9_-]*|\b[A-Za-z_][A-Za-z0-9_]*)(?P<sep>=|\s+)(?P<value>\S+)")


def is_secret_name(name: str) -> bool:
    """Whether a key or flag name (HF_TOKEN, --api-key, apiKey) names a value that is a secret."""
    # The last words decide: HF_TOKEN and OPENAI_API_KEY hold secrets, token_budget and HF_TOKEN_PATH do not.
    words = [w.upper() for w in _WORD_RE.findall(name.lstrip("-"))]
    return bool(words) and (words[-1] in _SECRET_WORDS or tuple(words[-2:]) in _SECRET_PAIRS)


def redact_text(text: str) -> str:
    """`text` with token-shaped values, bearer credentials, URL passwords and `SECRET_NAME=value` replaced by ***."""
    text = _TOKEN_RE.sub(REDACTED, text)
    text = _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _URL_PASSWORD_RE.sub(rf"\g<1>{REDACTED}@", text)

    def assignment(match: re.Match[str]) -> str:
        name, sep, value = match.group("name", "sep", "value")
        # A flag's value may follow a space; a bare word's only an "=" (so "token budget" stays as it is).
        if not is_secret_name(name) or (sep != "=" and not name.startswith("-")) or value == REDACTED:
            return match.group(0)
        return f"{name}{sep}{REDACTED}"

    return _ASSIGNMENT_RE.sub(assignment, text)


def _redact_args(args: list[Any]) -> list[Any]:
    out: list[Any] = []
    secret_next = False
    for arg in args:
        if secret_next and arg is not None:
            out.append(REDACTED)
            secret_next = False
            continue
        if isinstance(arg, str) and arg.startswith("-") and "=" not in arg and is_secret_name(arg):
            secret_next = True  # ["--api-key", "KEY"]: the next item is the value
        out.append(redact_data(arg))
    return out


def redact_data(data: Any) -> Any:
    """A copy of parsed data (a spec dump, run.json changes) with secret-named values and secret-shaped strings ***."""
    if isinstance(data, dict):
        return {
            key: REDACTED
            if isinstance(key, str) and is_secret_name(key) and value not in (None, "")
            else redact_data(value)
            for key, value in data.items()
        }
    if isinstance(data, list | tuple):
        return _redact_args(list(data))
    if isinstance(data, str):
        return redact_text(data)
    return data


def redact_spec_text(text: str) -> str:
    """A spec's YAML text with its secrets ***; unchanged (comments, layout and all) when it holds none."""
    import yaml

    from llmd.spec.yaml_input import load

    try:
        data = load(text)
    except yaml.YAMLError:
        return redact_text(text)
    clean = redact_data(data)
    if clean == data:
        return text
    return yaml.safe_dump(clean, sort_keys=False, allow_unicode=True)
