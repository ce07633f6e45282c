"""Typed reads of JSON request fields with pydantic's lax coercions and its error entries, as vLLM's request models
validate them (errors collected, not raised at the first)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import JsonDict, request_validation_error

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class Fields:
    """Reads typed fields out of a JSON object, collecting pydantic-style errors instead of stopping at the first."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.errors: list[JsonDict] = []

    def _err(self, kind: str, loc: tuple, msg: str, value: Any, ctx: JsonDict | None = None) -> None:
        err = {"type": kind, "loc": ("body", *loc), "msg": msg, "input": value}
        if ctx:
            err["ctx"] = ctx
        self.errors.append(err)

    def _int(self, value: Any, loc: tuple) -> int | None:
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if value.is_integer():
                return int(value)
            self._err(
                "int_from_float", loc, "Input should be a valid integer, got a number with a fractional part", value
            )
            return None
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                self._err(
                    "int_parsing", loc, "Input should be a valid integer, unable to parse string as an integer", value
                )
                return None
        self._err("int_type", loc, "Input should be a valid integer", value)
        return None

    def _float(self, value: Any, loc: tuple) -> float | None:
        if isinstance(value, bool | int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                self._err(
                    "float_parsing", loc, "Input should be a valid number, unable to parse string as a number", value
                )
                return None
        self._err("float_type", loc, "Input should be a valid number", value)
        return None

    def _bool(self, value: Any, loc: tuple) -> bool | None:
        if isinstance(value, bool):
            return value
        if isinstance(value, int | float) and value in (0, 1):
            return bool(value)
        if isinstance(value, str):
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            self._err("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", value)
            return None
        self._err("bool_type", loc, "Input should be a valid boolean", value)
        return None

    def get(self, name: str, kind: str, default: Any = None, *, nullable: bool = True, ge: int | None = None) -> Any:
        if name not in self.data:
            return default
        value = self.data[name]
        loc = (name,)
        if value is None:
            if nullable:
                return default if kind == "list" else None
            self._err(f"{kind}_type", loc, TYPE_MSG[kind], value)
            return default
        out: Any
        if kind == "int":
            out = self._int(value, loc)
        elif kind == "float":
            out = self._float(value, loc)
        elif kind == "bool":
            out = self._bool(value, loc)
        elif kind == "string":
            out = value if isinstance(value, str) else None
            if out is None:
                self._err("string_type", loc, "Input should be a valid string", value)
        elif kind == "dict":
            out = value if isinstance(value, dict) else None
            if out is None:
                self._err("dict_type", loc, "Input should be a valid dictionary", value)
        elif kind == "list":
            out = value if isinstance(value, list) else None
            if out is None:
                self._err("list_type", loc, "Input should be a valid list", value)
        else:  # pragma: no cover - programming error
            raise ValueError(kind)
        if out is None:
            return default
        if ge is not None and out < ge:
            self._err("greater_than_equal", loc, f"Input should be greater than or equal to {ge}", value, {"ge": ge})
            return default
        return out

    def int_list(self, name: str) -> list[int] | None:
        values = self.get(name, "list")
        if values is None:
            return None
        out = []
        for i, v in enumerate(values):
            n = self._int(v, (name, i))
            if n is not None:
                out.append(n)
        return out

    def raise_if_any(self) -> None:
        if self.errors:
            raise request_validation_error(self.errors)


TYPE_MSG = {
    "int": "Input should be a valid integer",
    "float": "Input should be a valid number",
    "bool": "Input should be a valid boolean",
    "string": "Input should be a valid string",
    "dict": "Input should be a valid dictionary",
    "list": "Input should be a valid list",
}
