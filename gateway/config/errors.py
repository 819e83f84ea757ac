"""The one exception an invalid configuration raises.

Its own module because both the schema (a Redis URL read from the environment is checked
when it is resolved) and loading raise it, and loading imports the schema.  A
``ValueError`` subclass, as callers catch it.
"""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """Invalid configuration: every line names the source, the field path and the problem."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = [f"{source}: {path}: {msg}" if path else f"{source}: {msg}" for path, msg in self.problems]
        super().__init__("\n".join(lines))
