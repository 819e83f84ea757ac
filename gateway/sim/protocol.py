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

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_NO_VALUE: Any = object()


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
            extras = [f"parameter={param}"] if param is not None else []
            if value is not None:
                extras.append(f"value={value}")
            if extras:
                message = f"{message} ({', '.join(extras)})"
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or self.TYPES.get(status, "InternalServerError" if status >= 500 else "Error")

    def body(self) -> bytes:
        return json.dumps(
            {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}
        ).encode()


def validation_error(exc: ValidationError) -> APIError:
    """Pydantic's complaint as one readable 400 (vLLM maps request validation to 400 too)."""
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    first = exc.errors(include_url=False)[0]["loc"] if exc.errors() else ()
    return APIError(400, "; ".join(parts) or "invalid request", param=str(first[0]) if first else None)


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
    n: int = Field(1, ge=1, le=128)
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


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
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


def usage(prompt: int, completion: int, cached: int | None, created: int | None = None) -> dict[str, Any]:
    """vLLM's ``UsageInfo``; ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``.

    ``created``: vLLM 0.32's ``created_cache_tokens`` (prompt tokens this request wrote into
    the prefix cache), reported by chat completions; completions leave it null.
    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached, "created_cache_tokens": created}
    return out


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
