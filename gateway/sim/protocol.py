"""The OpenAI-compatible wire format as vLLM speaks it: request models, errors, responses.

Request models accept unknown fields (vLLM has dozens of sampling extensions and clients
send them freely) and validate only what the simulator uses.  Errors follow vLLM's
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``; vLLM 0.32's request
validation errors (``VLLMValidationError``) end their message with
`` (parameter=NAME, value=VALUE)``, which ``APIError(..., value=...)`` reproduces.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

_NO_VALUE: Any = object()
_MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")


def with_refused(message: str, parameter: str | None, value: Any) -> str:
    """``message`` with vLLM 0.32's `` (parameter=…, value=…)`` suffix (whichever are known)."""
    extras = [f"parameter={parameter}"] if parameter is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return f"{message} ({', '.join(extras)})" if extras else message


class VLLMValidationError(ValueError):
    """vLLM's ``VLLMValidationError``, raised inside request validation (its "before" model
    validators): pydantic then reports ``Value error, <message> (parameter=...)``, and its
    ``repr`` (shown in the error's ``ctx``) is the bare message, as vLLM's is."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        return with_refused(super().__str__(), self.parameter, self.value)


def validate_cache_salt(cache_salt: object) -> None:
    """vLLM 0.32's check, before anything else in the request is validated."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise VLLMValidationError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", parameter="cache_salt"
        )
    if len(cache_salt) > _MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN_CHARS for c in cache_salt):
        raise VLLMValidationError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            parameter="cache_salt",
        )


class APIError(Exception):
    """An error the client caused or must see, rendered in vLLM's error shape."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowed",
        413: "RequestEntityTooLarge",
        422: "UnprocessableEntityError",
        429: "RateLimitError",
        500: "InternalServerError",
        501: "NotImplementedError",
        502: "BadGateway",
        503: "ServiceUnavailableError",
        504: "GatewayTimeout",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        err_type: str | None = None,
        *,
        value: Any = _NO_VALUE,
    ):
        if value is not _NO_VALUE:  # a VLLMValidationError: vLLM appends what was refused
            message = with_refused(message, param, value)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or self.TYPES.get(status, "InternalServerError" if status >= 500 else "Error")

    def body(self) -> bytes:
        return json.dumps(
            {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}
        ).encode()


_MAX_REPORTED_ERRORS = 10  # vLLM bounds the report (validation.py)
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


def validation_error(exc: ValidationError, where: str = "body") -> APIError:
    """Pydantic's complaint as vLLM 0.32's 400 for a ``RequestValidationError``.

    vLLM (FastAPI) reports ``N validation error(s):`` then one ``str(dict)`` line per error
    with ``loc`` dotted from ``body``, type ``"Bad Request"`` and ``param`` the first loc.
    """
    errors = exc.errors(include_url=False)
    if not errors:
        return APIError(400, "Validation error", err_type="Bad Request")
    locs = [".".join((where, *(str(p) for p in err["loc"]))) for err in errors]
    param = locs[0]
    for err in errors:  # a VLLMValidationError names its parameter itself
        raised = (err.get("ctx") or {}).get("error")
        if isinstance(raised, VLLMValidationError):
            param = raised.parameter or param
            break
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"{len(errors)} validation {label}:"]
    for err, loc in zip(errors[:_MAX_REPORTED_ERRORS], locs, strict=False):
        shown: dict[str, Any] = {"type": err["type"], "loc": loc, "msg": err["msg"]}
        if "input" in err:
            shown["input"] = _summarize_input(err["input"])
        if "ctx" in err:
            shown["ctx"] = err["ctx"]
        text = str(shown)
        lines.append("  " + (text[:_MAX_ERROR_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_CHARS else text))
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}")
    return APIError(400, "\n".join(lines), param=param, err_type="Bad Request")


def _summarize_input(value: Any) -> Any:
    if isinstance(value, str):
        return value[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_ERROR_INPUT_CHARS else value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


def parse(model: type[BaseModel], body: bytes) -> Any:
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        if exc.errors() and exc.errors()[0]["type"] == "json_invalid":
            raise APIError(400, f"invalid JSON body: {exc.errors()[0]['msg']}") from None
        raise validation_error(exc) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields shared by chat and completions.  Everything else is accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1  # checked as vLLM does (gateway.sim.sampling), after the prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    user: str | None = None
    # sampling parameters vLLM validates (SamplingParams._verify_args); None = its default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_before_checks(cls, data: Any) -> Any:
        """vLLM's "before" validators: they run first and stop the validation."""
        if isinstance(data, dict):
            validate_cache_salt(data.get("cache_salt"))
            if data.get("stream_options") and not data.get("stream"):
                raise VLLMValidationError(
                    "Stream options can only be defined when `stream=True`.", parameter="stream_options"
                )
        return data


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1, le=4096)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def check_messages(messages: list[dict[str, Any]]) -> None:
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise APIError(400, f"messages.{i}.role: a non-empty string is required", param="messages")


def check_token_ids(ids: list[int], param: str) -> None:
    for tok in ids:
        if tok < 0 or tok >= 1 << 31:
            raise APIError(400, f"token id {tok} is out of vocabulary", param=param)


def usage(
    prompt: int, completion: int, cached: int | None, created: int | None = None, *, stream: bool = False
) -> dict[str, Any]:
    """vLLM 0.32's ``UsageInfo`` as it serializes it.

    ``cached`` is None without ``--enable-prompt-tokens-details``.  ``created``: vLLM 0.32's
    ``created_cache_tokens`` (prompt tokens this request wrote into the prefix cache), which
    chat completions report and completions leave null.  A response body carries every field
    (nulls included); a stream's usage chunk leaves the null ones out, as vLLM's does.
    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    details: dict[str, Any] | None = None
    if cached is not None:
        details = {"cached_tokens": cached, "created_cache_tokens": created, "multimodal_tokens": None}
    if not stream:
        out["prompt_tokens_details"] = details
        out["completion_tokens_details"] = None
    elif details is not None:
        out["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
    return out


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
