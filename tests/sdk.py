"""The OpenAI SDK client the tests use, without the CA bundle load each client pays.

The SDK's own HTTP client builds a verifying TLS context, which reads the CA bundle (~30 ms);
helpers that make a client per request (``replica_of`` loops) paid that hundreds of times a
run. Every server the tests talk to is plain ``http://127.0.0.1``, so no certificate is ever
checked: the client here is the SDK's default HTTP client with verification off, otherwise
the same (timeouts, limits, redirects), and one per SDK client as before.
"""

from __future__ import annotations

from typing import Any

from openai import DefaultHttpxClient, OpenAI


def openai_client(base_url: str, **kwargs: Any) -> OpenAI:
    """``OpenAI(base_url=..., **kwargs)`` with ``max_retries=0`` unless given, for plain-HTTP test servers."""
    kwargs.setdefault("max_retries", 0)
    if "http_client" not in kwargs:
        kwargs["http_client"] = DefaultHttpxClient(verify=False)
    return OpenAI(base_url=base_url, **kwargs)
