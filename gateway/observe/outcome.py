"""What one finished request leaves behind: a flat record the recorder turns into numbers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class Outcome:
    """One request's result.  ``None`` means unknown (never 0 by default)."""

    route: str  # "none" when no route matched
    endpoint: str
    status: int  # HTTP status sent to the client (499: client went away)
    replica: str | None = None
    policy: str | None = None
    reason: str | None = None  # Decision.reason (policy branch)
    error_kind: str | None = None  # GatewayError.kind / upstream failure kind
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, None if absent
    predicted_cached_tokens: int | None = None  # Decision.detail["predicted_cached_tokens"]
    predicted_units: str | None = None  # what the prediction counts: "exact (llama3)", "approximate (cl100k_base)"
    normalize_mode: str | None = None
    normalized: Mapping[str, int] = field(default_factory=dict)
    retries: int = 0
    stream: bool = False
    duration_s: float = 0.0
    ttft_s: float | None = None
    added_s: float | None = None  # time the gateway itself spent (before + after the upstream call)
    queued_s: float | None = None  # time held in flow control's queue (None: not held)
    queued_note: str | None = None  # flow control's line for a held request (gateway.flow.gate.Placement)

    def take_usage(self, prompt_tokens: int | None, completion_tokens: int | None, cached_tokens: int | None) -> None:
        """The replica's reported usage; a prediction is capped at the prompt (past the token
        window the prompt length is an estimate: never predict more than the prompt)."""
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt_tokens, completion_tokens, cached_tokens
        if self.predicted_cached_tokens is not None and prompt_tokens is not None:
            self.predicted_cached_tokens = min(self.predicted_cached_tokens, prompt_tokens)

    @property
    def prediction_miss(self) -> int | None:
        """Predicted minus reported cached tokens (positive: the gateway predicted more than the
        engine hit); None unless the request had both."""
        if self.predicted_cached_tokens is None or self.cached_tokens is None:
            return None
        return self.predicted_cached_tokens - self.cached_tokens

    @property
    def status_class(self) -> str:
        return f"{self.status // 100}xx"
