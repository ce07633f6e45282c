"""Load a deployment spec from YAML, report every problem in it at once in plain words, and dump the resolved spec.

YAML is read with YAML 1.2-style scalars (only true/false are booleans, no base-60 numbers, no dates) and duplicate
keys are refused, so what a user wrote is what the spec gets; files and aliases are bounded (llmd.spec.yaml_input).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from llmd.spec.checks import SpecError, SpecIssue, run_checks
from llmd.spec.model import SKIP_CHECKS, DeploymentSpec
from llmd.spec.values import printable
from llmd.spec.yaml_input import BoundedLoader, InputFileError, YAMLLimitError, read_text, unreadable_value
from llmd.spec.yaml_input import load as load_bounded

EXAMPLE = "examples/tiny-local.yaml"

_BOOL_TAG = "tag:yaml.org,2002:bool"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT_RE = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F][0-9a-fA-F_]*|0o[0-7][0-7_]*)$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?"
    r"|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
    r"|[0-9][0-9_]*[eE][-+]?[0-9]+"
    r"|\.(?:inf|Inf|INF))"
    r"|\.(?:nan|NaN|NAN))$"
)


def _yaml12_resolvers(base: type[yaml.resolver.BaseResolver]) -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    # YAML 1.1 reads `yes`/`on` as true, `1:30:00` as 5400 and `0755` as octal; none of that is what a spec author
    # means, so those resolvers are dropped and replaced by the YAML 1.2 core-schema ones below.
    replaced = {_BOOL_TAG, _INT_TAG, _FLOAT_TAG, _TIMESTAMP_TAG}
    return {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in replaced]
        for first, resolvers in base.yaml_implicit_resolvers.items()
    }


class _SpecLoader(BoundedLoader):
    yaml_implicit_resolvers = _yaml12_resolvers(yaml.SafeLoader)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        sign = -1 if text.startswith("-") else 1
        digits = text.lstrip("+-")
        if digits.startswith("0x"):
            return sign * int(digits[2:], 16)
        if digits.startswith("0o"):
            return sign * int(digits[2:], 8)
        return sign * int(digits, 10)


def load_yaml(text: str) -> Any:
    """YAML read by the spec's rules (a SafeLoader, YAML 1.2 scalars), for files that hold spec fragments (sweeps)."""
    return load_bounded(text, _SpecLoader)


class _SpecDumper(yaml.SafeDumper):
    """Quotes any string the spec loader would read as something else, so dumps load back unchanged."""


for _cls in (_SpecLoader, _SpecDumper):
    _cls.add_implicit_resolver(_BOOL_TAG, _BOOL_RE, list("tTfF"))
    _cls.add_implicit_resolver(_INT_TAG, _INT_RE, list("-+0123456789"))
    _cls.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))
_SpecLoader.add_constructor(_INT_TAG, _SpecLoader.construct_yaml_int)


def _join(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _walk(
    node: yaml.Node, prefix: str = "", parents: frozenset[int] = frozenset()
) -> Iterator[tuple[str, yaml.Node, yaml.MappingNode | None]]:
    """Yield (dotted path, node, the mapping it is a key of) for every key and list item under `node`."""
    if id(node) in parents:  # an alias of one of its own ancestors
        return
    parents = parents | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                path = _join(prefix, key.value)
                yield path, key, node
                yield from _walk(value, path, parents)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = _join(prefix, index)
            yield path, item, None
            yield from _walk(item, path, parents)


def _duplicate_keys(root: yaml.Node) -> list[SpecIssue]:
    issues: list[SpecIssue] = []
    seen: dict[tuple[int, str], int] = {}
    for path, key, mapping in _walk(root):
        if mapping is None:
            continue
        line = key.start_mark.line + 1
        first = seen.setdefault((id(mapping), str(key.value)), line)
        if first != line:
            issues.append(
                SpecIssue(
                    path,
                    f'duplicate key "{key.value}", first given at line {first}; YAML would silently keep only the '
                    "last one, so delete one of them",
                    line,
                )
            )
    return issues


def _line_index(root: yaml.Node) -> dict[str, int]:
    lines: dict[str, int] = {}
    for path, node, _ in _walk(root):
        lines.setdefault(path, node.start_mark.line + 1)
    return lines


def _with_line(issue: SpecIssue, lines: dict[str, int]) -> SpecIssue:
    # A problem with a key the file does not set (a default) points at the nearest section the file does set.
    if issue.line is not None:
        return issue
    parts = issue.path.split(".") if issue.path else []
    while parts:
        line = lines.get(".".join(parts))
        if line is not None:
            return SpecIssue(issue.path, issue.message, line)
        parts.pop()
    return issue


def _yaml_issue(exc: yaml.YAMLError) -> SpecIssue:
    if isinstance(exc, YAMLLimitError):
        return SpecIssue("", str(exc))
    if isinstance(exc, yaml.reader.ReaderError) and isinstance(exc.character, int):
        return SpecIssue(
            "",
            f"holds the character U+{exc.character:04X} at position {exc.position}, which YAML does not allow in a "
            "file; remove it",
        )
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return SpecIssue("", f"is not valid YAML: {exc}")
    mark = exc.problem_mark
    problem = exc.problem or "invalid YAML"
    if "expected a single document" in str(exc.context):
        message = f"found a second YAML document at line {mark.line + 1}; a spec is one document, so remove the '---'"
        return SpecIssue("", message, mark.line + 1)
    hint = "; YAML indents with spaces, not tabs" if "'\\t'" in problem else ""
    what = "YAML syntax error"
    if isinstance(exc, yaml.constructor.ConstructorError):
        what = "YAML error"
        if "tag" in problem:
            hint = "; a spec takes plain YAML values, without !! tags"
    context = f" ({exc.context} at line {exc.context_mark.line + 1})" if exc.context and exc.context_mark else ""
    return SpecIssue(
        "",
        f"{what} at line {mark.line + 1}, column {mark.column + 1}: {problem}{context}{hint}",
        mark.line + 1,
    )


def _read(path: str | os.PathLike[str]) -> str:
    source = os.fspath(path)
    try:
        return read_text(source, "spec file")
    except InputFileError as exc:
        problem = f"no such spec file: {source}; start from {EXAMPLE}" if exc.missing else exc.problem
        raise SpecError(source, [SpecIssue("", problem)]) from None


# ---- pydantic errors in words -------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML: strings quoted, null, true/false."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    # json.dumps escapes C0 controls but not DEL, C1 or U+2028: those must not reach a terminal raw either.
    text = printable(json.dumps(value, ensure_ascii=False, default=str))
    if len(text) <= 60:
        return text
    return text[:56] + '..."' if isinstance(value, str) else text[:57] + "..."


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = DeploymentSpec
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _default(loc: tuple[Any, ...]) -> Any:
    model = _model_at(loc[:-1])
    field = model.model_fields.get(loc[-1]) if model and loc and isinstance(loc[-1], str) else None
    return field.get_default(call_default_factory=True) if field else None


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _choices(expected: str) -> list[str]:
    return re.findall(r"'([^']*)'", expected)


def _unknown_key(loc: tuple[Any, ...]) -> str:
    key = str(loc[-1])
    model = _model_at(loc[:-1])
    allowed = list(model.model_fields) if model else []
    message = f'unknown key "{key}"' + _did_you_mean(key, allowed)
    if "did you mean" not in message:
        # A right key in the wrong section (`block_size:` under decode) is the commonest slip; point at its home.
        sections = ((name, _model_at((name,))) for name in DeploymentSpec.SECTIONS)
        homes = [f"{name}.{key}" for name, section in sections if section and key in section.model_fields]
        if homes:
            message += f"; it belongs in {' or '.join(homes)}"
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    return f"{message}; allowed keys in {where}: {', '.join(allowed)}"


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping of keys",
    "model_attributes_type": "a mapping of keys",
}
_KEY_NOUNS = {"router.weights": "scorer", "router.tier_weights": "KV tier"}


def _type_problem(kind: str, value: Any, loc: tuple[Any, ...]) -> str:
    message = f"{_show(value)} is not {_EXPECTED[kind]}"
    if isinstance(value, list | dict):
        message += f" (it is {_kind(value)})"
    if value is None:
        default = _default(loc)
        tail = f" to get the default ({_show(default)})" if default is not None else " to get the default"
        return f"{message}; the key has no value: give one, or delete the line{tail}"
    if kind == "bool_type":
        return f"{message}; write true or false"
    if kind in ("int_type", "float_type") and isinstance(value, str) and re.fullmatch(r"[-+]?[0-9._eE+-]+", value):
        return f"{message}; write {value} without quotes"
    if kind == "string_type" and isinstance(value, int | float | bool):
        return f'{message}; quote it: "{_show(value)}"'
    if kind == "model_type":
        return f"{message}; write the section as indented keys under {'.'.join(map(str, loc))}:"
    return message


def _bound_problem(kind: str, value: Any, ctx: dict[str, Any], path: str) -> str:
    if kind == "greater_than_equal" and ctx.get("ge") == 0:
        what = "weights" if path.startswith(tuple(_KEY_NOUNS)) else "it"
        note = " (0 turns a scorer off)" if path.startswith("router.weights") else ""
        return f"{_show(value)} is negative; {what} must be >= 0{note}"
    relation = {
        "greater_than_equal": ("too small", ">=", "ge"),
        "greater_than": ("too small", ">", "gt"),
        "less_than_equal": ("too large", "<=", "le"),
        "less_than": ("too large", "<", "lt"),
    }[kind]
    return f"{_show(value)} is {relation[0]}; it must be {relation[1]} {ctx[relation[2]]}"


def issue_from_error(error: ErrorDetails) -> SpecIssue:
    """Turn one pydantic error into `<path>: <value given> <problem>; <what is allowed>`."""
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    loc = tuple(error["loc"])
    is_key = bool(loc) and loc[-1] == "[key]"
    if is_key:
        loc = loc[:-1]
    path = ".".join(_show(part) if part is None else str(part) for part in loc)
    parent = ".".join(str(part) for part in loc[:-1])
    if kind == "extra_forbidden":
        return SpecIssue(path, _unknown_key(loc))
    if is_key and kind == "literal_error":
        choices = _choices(ctx.get("expected", ""))
        noun = _KEY_NOUNS.get(parent, "key")
        message = f'unknown {noun} "{value}"{_did_you_mean(str(value), choices)}; use one of: {", ".join(choices)}'
        return SpecIssue(path, message)
    if is_key and kind == "value_error":
        return SpecIssue(path, f"key {_show(value)} in {parent} {ctx.get('error')}")
    if is_key:
        return SpecIssue(path, f"key {_show(value)} in {parent} is not a string; quote it")
    if kind == "invalid_key":
        return SpecIssue(path, f"key {_show(value)} is not a string; section names are words like model or decode")
    if kind == "literal_error":
        choices = _choices(ctx.get("expected", ""))
        hint = _did_you_mean(str(value), choices) if isinstance(value, str) else ""
        return SpecIssue(path, f"{_show(value)} is not a valid choice{hint}; use one of: {', '.join(choices)}")
    if kind in _EXPECTED:
        return SpecIssue(path, _type_problem(kind, value, loc))
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return SpecIssue(path, _bound_problem(kind, value, ctx, path))
    if kind == "value_error":
        return SpecIssue(path, f"{_show(value)} {ctx.get('error')}")
    if kind == "finite_number":
        return SpecIssue(path, f"{_show(value)} is not a finite number")
    return SpecIssue(path, f"{_show(value)} is not allowed: {error['msg']}")


# ---- validation ---------------------------------------------------------------------------------------------------


def _validate(data: dict[Any, Any]) -> tuple[DeploymentSpec | None, list[SpecIssue]]:
    context = {SKIP_CHECKS: True}
    try:
        spec = DeploymentSpec.model_validate(data, context=context)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    else:
        return spec, run_checks(spec)
    issues = [issue_from_error(error) for error in errors]
    # Run the semantic checks on every section that did parse, so the user sees those problems now rather than
    # after fixing the type errors; a section that failed is left at its defaults and its checks are skipped.
    failed = {error["loc"][0] for error in errors if error["loc"]}
    if any(not error["loc"] for error in errors):
        return None, issues
    kept = {k: v for k, v in data.items() if k in DeploymentSpec.model_fields and k not in failed}
    try:
        partial = DeploymentSpec.model_validate(kept, context=context)
    except ValidationError:
        return None, issues
    parsed = [section for section in DeploymentSpec.SECTIONS if section not in failed]
    return None, issues + run_checks(partial, parsed)


def _not_a_mapping(data: Any) -> SpecIssue:
    return SpecIssue(
        "",
        f"the spec must be a mapping of sections (name:, model:, prefill:, decode:, ...), but it holds {_kind(data)} "
        f"{_show(data)}; start from {EXAMPLE}",
    )


def parse_spec(data: Any, source: str = "<spec>") -> DeploymentSpec:
    """Validate already-loaded data (a dict, as from YAML or JSON); raise SpecError listing every problem."""
    if not isinstance(data, dict):
        raise SpecError(source, [_not_a_mapping(data)])
    spec, issues = _validate(data)
    if issues or spec is None:
        raise SpecError(source, issues)
    return spec


def parse_spec_text(text: str, source: str = "<spec>") -> DeploymentSpec:
    """Parse a spec from YAML text; raise SpecError listing every problem, with line numbers."""
    try:
        loader = _SpecLoader(text)  # reads the whole text at once: an unprintable character fails here
    except yaml.YAMLError as exc:
        raise SpecError(source, [_yaml_issue(exc)]) from None
    try:
        root = loader.get_single_node()
        if root is None:
            raise SpecError(source, [SpecIssue("", f"spec is empty; start from {EXAMPLE}")])
        issues = _duplicate_keys(root)
        data = loader.construct_document(root)
    except yaml.YAMLError as exc:
        raise SpecError(source, [_yaml_issue(exc)]) from None
    except ValueError as exc:  # an integer longer than Python converts
        raise SpecError(source, [SpecIssue("", unreadable_value(exc))]) from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise SpecError(source, [_not_a_mapping(data)])
    spec, more = _validate(data)
    lines = _line_index(root)
    issues += [_with_line(issue, lines) for issue in more]
    if issues or spec is None:
        raise SpecError(source, issues)
    return spec


def load_spec(path: str | os.PathLike[str]) -> DeploymentSpec:
    """Load and validate a spec file; raise SpecError (a UserError) naming the file and listing every problem."""
    return parse_spec_text(_read(path), os.fspath(path))


def check_spec(path: str | os.PathLike[str]) -> list[SpecIssue]:
    """Every problem in a spec file; empty when it is valid."""
    try:
        load_spec(path)
    except SpecError as exc:
        return exc.errors
    return []


def dump_spec(spec: DeploymentSpec) -> str:
    """The resolved spec as YAML, every default filled in; `parse_spec_text(dump_spec(s)) == s`."""
    data = spec.model_dump(mode="json")
    return yaml.dump(data, Dumper=_SpecDumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)
