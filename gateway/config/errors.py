"""The one exception an invalid configuration raises.

Its own module because both the schema (a Redis URL read from the environment is checked
when it is resolved) and loading raise it, and loading imports the schema.  It sits in the
gateway's one error tree (:class:`gateway.errors.SetupError`: what the config asks for cannot
be set up) and stays a ``ValueError``, as callers catch it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.errors import SetupError


class ConfigError(SetupError, ValueError):
    """Invalid configuration: every line names the source, the field path and the problem."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = [f"{source}: {path}: {msg}" if path else f"{source}: {msg}" for path, msg in self.problems]
        super().__init__("\n".join(lines))
