"""Request bodies the OpenAI routes cannot serve, found before the routes read them (pure
functions; serve_app/ingress.py answers 400 with what they say).

The routes' own parsing (FastAPI, then the request models of Ray Serve LLM and vLLM) answers
most bad input with a 400 naming the field. These are the inputs it turns into 500s instead:
- a lone UTF-16 surrogate: JSON's `"\\ud800"` escape decodes to one, but no UTF-8 text can
  hold it, so the tokenizer, or the validation error that quotes it, fails;
- NaN and Infinity, which Python's JSON parser accepts but no JSON encoder writes back, so
  the validation error that quotes them fails;
- a value of the wrong type where a request model's own pre-validation assumes the right one
  (vLLM's validators call `.get` on `structured_outputs` before checking it is an object).
"""

from __future__ import annotations

import json

from pydantic import BaseModel


class _NotFinite(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    raise _NotFinite(name)


def invalid_unicode_at(value: object, where: str = "body") -> str | None:
    """Where in a parsed JSON value a string (or an object's key) holds a lone UTF-16
    surrogate, as `body.messages[0].content`; None when all of it is valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        items = [(f"{where} key {k!r}", k) for k in value] + [(f"{where}.{k}", v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for item_where, item in items:
        if (found := invalid_unicode_at(item, item_where)) is not None:
            return found
    return None


def body_problem(raw: bytes, model: type[BaseModel] | None = None) -> str | None:
    """Why a request body cannot be served, for the problems above; None when the route can
    answer it itself (a valid body, or one its parsing refuses with a 400: not JSON, wrong
    types). `model`: the route's request model, None for a route without one."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except _NotFinite as e:
        return f"{e} is not a JSON number: every number must be finite"
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deeply
        return None
    if (where := invalid_unicode_at(value)) is not None:
        return f"{where} is not valid Unicode (a lone UTF-16 surrogate such as \\ud800)"
    if model is not None:
        try:
            model.model_validate(value)
        except ValueError:  # pydantic's ValidationError: the route answers, naming the field
            pass
        except Exception as e:  # noqa: BLE001 - a validator that assumed a type
            return f"a field has a value of the wrong type ({type(e).__name__}: {e})"
    return None
