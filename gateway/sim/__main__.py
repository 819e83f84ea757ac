"""``python -m gateway.sim`` is ``prefix-gateway sim`` without the top-level CLI."""

from __future__ import annotations

import sys

from gateway.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
