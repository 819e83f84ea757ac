"""``python -m gateway`` is ``prefix-gateway``."""

from gateway.cli import main

raise SystemExit(main())
