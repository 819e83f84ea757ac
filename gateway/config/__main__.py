"""``python -m gateway.config --markdown | --update docs/config.md`` (see :mod:`gateway.config.reference`).

The command ``docs/config.md`` and its test name; a package runs only through a ``__main__``.
"""

import sys

from gateway.config.reference import main

main(sys.argv[1:])
