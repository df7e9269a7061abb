"""Every failure as OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import dataclasses
from typing import Optional

from fastapi.responses import JSONResponse

from pagedserve.sampling_params import SamplingParams

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Request fields that the engine's ValueErrors may name, besides SamplingParams' own.
_REQUEST_FIELDS = _SAMPLING_FIELDS | {"priority"}
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class OpenAIError(Exception):
    """An HTTP error with OpenAI's body. `error_type` overrides the status's usual `type` (OpenAI's rate-limit
    errors say which limit: "requests" or "tokens")."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None, error_type: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers
        self.error_type = error_type

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status, self.param, self.code, self.headers, self.error_type)


def error_response(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None, error_type: Optional[str] = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def from_value_error(error: ValueError, rename: Optional[dict[str, str]] = None) -> OpenAIError:
    """A 400 from SamplingParams' (or the engine's) ValueError; `param` is the parameter it names, spelled as
    the request spells it (`rename` maps SamplingParams names to request field names)."""
    message = str(error)
    first = message.split(" ", 1)[0]
    param = first if first in _REQUEST_FIELDS else None
    if param is not None and rename:
        param = rename.get(param, param)
    return OpenAIError(message, 400, param=param)


def from_validation_error(error) -> OpenAIError:
    """A 400 from a pydantic ValidationError: the first problem, with its location as `param`."""
    first = error.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    message = f"{'.'.join(loc)}: {first.get('msg')}" if loc else str(first.get("msg"))
    return OpenAIError(message, 400, param=loc[0] if loc else None)
