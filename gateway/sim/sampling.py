"""vLLM 0.32's sampling-parameter checks (``SamplingParams._verify_args``), in its order.

The simulator ignores these parameters when "generating", but a client (or the gateway)
must meet the same 400s as with a real engine: ``temperature: -1`` is refused, not served.
Messages are vLLM's; those vLLM raises with a parameter carry its
`` (parameter=NAME, value=VALUE)`` suffix, the others do not (as in vLLM).
"""

from __future__ import annotations

import math

from gateway.sim.protocol import APIError

_SAMPLING_EPS = 1e-5  # vLLM: temperatures below this are greedy
MAX_N = 128  # vLLM allows VLLM_MAX_N_SEQUENCES (16,384); a simulator process keeps it small


def check_sampling(req: object, max_tokens: int, n: int) -> None:
    """Raise vLLM's 400 for the first invalid sampling parameter of ``req``.

    ``max_tokens`` is the value after vLLM's clamping (``get_max_tokens``), so a prompt
    that fills the context leaves 0 and fails here, as it does in vLLM.
    """
    presence = _get(req, "presence_penalty", 0.0)
    frequency = _get(req, "frequency_penalty", 0.0)
    repetition = _get(req, "repetition_penalty", 1.0)
    temperature = _get(req, "temperature", 1.0)
    top_p = _get(req, "top_p", 1.0)
    top_k = getattr(req, "top_k", None)
    min_p = _get(req, "min_p", 0.0)
    if n < 1:
        raise APIError(400, f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise APIError(
            400,
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable.",
        )
    if not -2.0 <= presence <= 2.0:
        raise APIError(400, f"presence_penalty must be in [-2, 2], got {presence}.")
    if not -2.0 <= frequency <= 2.0:
        raise APIError(400, f"frequency_penalty must be in [-2, 2], got {frequency}.")
    if not math.isfinite(repetition):
        raise APIError(400, f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise APIError(400, f"repetition_penalty must be greater than zero, got {repetition}.")
    if not math.isfinite(temperature):
        raise _invalid(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
    if temperature < 0.0:
        raise _invalid(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise _invalid(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if not 0.0 < top_p <= 1.0:
        raise _invalid(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if top_k is not None and top_k < -1:
        raise APIError(400, f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise APIError(400, f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise _invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if temperature < _SAMPLING_EPS and n > 1:
        raise APIError(400, f"n must be 1 when using greedy sampling, got {n}.")


def _get(req: object, name: str, default: float) -> float:
    value = getattr(req, name, None)
    return default if value is None else float(value)


def _invalid(message: str, param: str, value: object) -> APIError:
    return APIError(400, message, param=param, value=value)
