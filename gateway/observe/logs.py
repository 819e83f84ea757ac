"""Logging setup, the quiet access log, and JSON/text formatting.

Access lines skip ``/health``, ``/ready`` and ``/metrics`` unless ``access_log_probes`` is on
(probe noise is what buries vLLM's own numbers).  Lines carry ids, statuses, timings and
token counts — never prompt text or credentials.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from gateway.config import LoggingSettings

ACCESS_LOGGER = "prefix_gateway.access"
SUMMARY_LOGGER = "prefix_gateway.summary"
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus structured ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(settings: LoggingSettings) -> None:
    """Install one stderr handler on the root logger (idempotent)."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_prefix_gateway", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler._prefix_gateway = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if settings.format == "json" else logging.Formatter(TEXT_FORMAT))
    root.setLevel(settings.level.upper())
    for name in ("uvicorn.access",):  # ours replaces it
        logging.getLogger(name).disabled = True


def log_safe(text: str) -> str:
    """``text`` with control characters, backslashes and quotes escaped, for one log line.

    The request path is percent-decoded by the server: ``/v1/x%0A2026-... INFO forged`` would
    otherwise start a forged line in the text log (and a quote would end the quoted field).
    Printable text (every normal path) is returned as is, after one C-speed check.
    """
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch == '"' or ch == "\\":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def _plain(value: Any) -> str:
    """A key=value field's value: quoted (JSON) when it holds a space, so the line still splits."""
    text = str(value)
    return json.dumps(text) if " " in text else text


class AccessLog:
    """Writes one line per finished request (called by the access middleware)."""

    def __init__(self, settings: LoggingSettings) -> None:
        self.enabled = settings.access_log
        self.probes = settings.access_log_probes
        self._log = logging.getLogger(ACCESS_LOGGER)

    def wants(self, path: str) -> bool:
        return self.enabled and (self.probes or path not in PROBE_PATHS)

    def write(
        self,
        client: str,
        method: str,
        path: str,
        status: int,
        duration_s: float,
        request_id: str,
        info: Mapping[str, Any] | None,
    ) -> None:
        if not self._log.isEnabledFor(logging.INFO):
            return
        method, path = log_safe(method), log_safe(path)
        fields: dict[str, Any] = {
            "client": client,
            "method": method,
            "path": path,
            "status": status,
            "duration_ms": round(duration_s * 1000, 2),
            "request_id": request_id,
        }
        if info:
            fields.update(info)
        extra = " ".join(f"{k}={_plain(v)}" for k, v in (info or {}).items() if v is not None)
        self._log.info(
            '%s "%s %s" %d %.1fms rid=%s%s',
            client,
            method,
            path,
            status,
            duration_s * 1000,
            request_id,
            f" {extra}" if extra else "",
            extra={"fields": fields},
        )
