"""vLLM's error bodies for the simulated engine: the ErrorResponse shape, message sanitizing, and the 400/404/500/503
errors its handlers raise (vllm/entrypoints/serve/exception_handling/)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

JsonDict = dict[str, Any]


_SANITIZE = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


def sanitize_message(message: str) -> str:
    """vLLM strips addresses, tracebacks and file paths from every error message it returns."""
    for pattern, repl in _SANITIZE:
        message = pattern.sub(repl, message)
    return message.strip()


class APIError(Exception):
    """An error answered as vLLM's ErrorResponse: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.code = code
        self.param = param

    def body(self) -> JsonDict:
        return error_body(self.message, self.err_type, self.code, self.param)


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400, param: str | None = None) -> JsonDict:
    return {"error": {"message": sanitize_message(message), "type": err_type, "param": param, "code": code}}


def validation_error(message: str, parameter: str | None = None, value: Any = None) -> APIError:
    """vLLM's VLLMValidationError: 400 BadRequestError whose message carries `(parameter=..., value=...)`."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return APIError(text, "BadRequestError", 400, parameter)


def model_not_found(model: str, served_names: Sequence[str]) -> APIError:
    # vllm/entrypoints/serve/engine/serving.py BaseServing._check_model
    return APIError(
        f"The model `{model}` does not exist. Valid aliases: {', '.join(served_names)}.", "NotFoundError", 404, "model"
    )


def internal_error(message: str = "Internal server error") -> APIError:
    """vLLM's GenerationError (finish_reason "error", e.g. a failed KV load): 500 InternalServerError."""
    return APIError(message, "InternalServerError", 500)


def service_unavailable(message: str) -> APIError:
    """vLLM's GracefulHTTPError with 503 (QueueOverflowError and friends): type is the HTTP phrase."""
    return APIError(message, "Service Unavailable", 503)


def _summarize_input(value: Any) -> Any:
    # vllm handlers/validation.py _summarize_error_input: containers are described, long text truncated.
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def request_validation_error(errors: Sequence[JsonDict | str]) -> APIError:
    """FastAPI's RequestValidationError as vLLM renders it: type "Bad Request", param the first error's location."""
    param = None
    lines = []
    for err in errors[:10]:
        if isinstance(err, dict):
            shown = dict(err)
            loc = shown.get("loc")
            if isinstance(loc, tuple | list):
                shown["loc"] = ".".join(str(p) for p in loc)
            if "input" in shown:
                shown["input"] = _summarize_input(shown["input"])
            text = str(shown)
            lines.append(text if len(text) <= 1000 else text[:1000] + "...[truncated]")
        else:
            lines.append(str(err))
    first = errors[0] if errors else None
    if isinstance(first, dict) and first.get("loc"):
        param = ".".join(str(p) for p in first["loc"])
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if count > 10:
        message += f"  ...and {count - 10} more {label}\n"
    return APIError(message.rstrip(), "Bad Request", 400, param)
