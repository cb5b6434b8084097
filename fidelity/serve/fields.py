"""Typed reads of request fields, each failure a 400 that names the field and says what
it must be (a real client sent `max_tokens: 1.5` and got "must be a number")."""
from __future__ import annotations

import json
import logging

from .errors import ApiError


def _kind(kind) -> str:
    return "an integer" if kind is int else "a number"


class Fields:
    def __init__(self, body: dict, where: str = ""):
        self.body, self.where = body, where

    def _name(self, key: str) -> str:
        return f"{self.where}{key}"

    def num(self, key: str, default, lo=None, hi=None, kind=float):
        v = self.body.get(key)
        if v is None:
            return default
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok and kind is int and not float(v).is_integer():
            ok = False
        if not ok:
            raise ApiError(f"{self._name(key)} must be {_kind(kind)}, got {v!r}", self._name(key))
        v = kind(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
            raise ApiError(f"{self._name(key)} must be {rng}, got {v}", self._name(key))
        return v

    def integer(self, key: str, default, lo=None, hi=None) -> int:
        return self.num(key, default, lo, hi, int)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self.body.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ApiError(f"{self._name(key)} must be true or false, got {v!r}", self._name(key))
        return v

    def string(self, key: str, default: str | None = None) -> str | None:
        v = self.body.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise ApiError(f"{self._name(key)} must be a string, got {v!r}", self._name(key))
        return v

    def strings(self, key: str) -> list[str]:
        """A string or a list of non-empty strings (stop sequences)."""
        v = self.body.get(key)
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not (isinstance(v, list) and all(isinstance(s, str) and s for s in v)):
            raise ApiError(f"{self._name(key)} must be a string or a list of non-empty strings",
                           self._name(key))
        return v

    def ids(self, key: str, vocab: int) -> list[int]:
        """A list of token ids in [0, vocab)."""
        v = self.body.get(key)
        if v is None:
            return []
        if not (isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)):
            raise ApiError(f"{self._name(key)} must be a list of token ids", self._name(key))
        bad = [i for i in v if not 0 <= i < vocab]
        if bad:
            raise ApiError(f"{self._name(key)}: token id {bad[0]} is out of range [0, {vocab})",
                           self._name(key))
        return v

    def refuse(self, key: str, why: str, allowed=(None,)) -> None:
        """A field we do not implement: a 400 naming it instead of silently ignoring it."""
        if key in self.body and self.body[key] not in allowed:
            raise ApiError(f"{self._name(key)} is not supported by fidelity serve: {why}",
                           self._name(key))

    def logit_bias(self, vocab: int) -> dict[int, float]:
        """OpenAI's logit_bias: {"token id": bias in [-100, 100]}."""
        v = self.body.get("logit_bias")
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ApiError("logit_bias must be an object mapping token ids to biases", "logit_bias")
        out = {}
        for k, b in v.items():
            try:
                i = int(k)
            except (TypeError, ValueError):
                raise ApiError(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
            if not 0 <= i < vocab:
                raise ApiError(f"logit_bias: token id {i} is out of range [0, {vocab})", "logit_bias")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ApiError(f"logit_bias[{k}] must be a number in [-100, 100], got {b!r}",
                               "logit_bias")
            out[i] = float(b)
        return out


async def read_json(request) -> dict:
    """The request body as a JSON object; 400 naming the problem otherwise (a text/plain
    body, invalid JSON, or JSON that is not an object)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise ApiError(f"Content-Type must be application/json, got {ctype!r} (curl: add "
                       "-H 'Content-Type: application/json')", "content-type")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


_log = logging.getLogger("fidelity.serve")
_warned: set[tuple[str, str]] = set()


def warn_unknown(route: str, body: dict, known) -> list[str]:
    """Fields the route does not read: served anyway (as vLLM does), but each field name
    is logged once per route so a client's misspelt or unsupported option is seen."""
    unknown = sorted(k for k in body if k not in known)
    for k in unknown:
        if (route, k) not in _warned:
            _warned.add((route, k))
            _log.warning("%s: request field %r is not used by fidelity serve and was ignored "
                         "(logged once per field)", route, k)
    return unknown
