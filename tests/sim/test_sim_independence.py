"""The simulator never borrows the gateway's tokenizer, chat template or block hashing.

If it did, a gateway predicting the wrong tokens would agree with its own replicas and no test
could notice (issue 8).  Checked on the source: every import in gateway/sim/.
"""

from __future__ import annotations

import ast
from pathlib import Path

SIM = Path(__file__).resolve().parents[2] / "gateway" / "sim"
FORBIDDEN = (
    "gateway.tokens",
    "gateway.prefix",
)


def test_sim_imports_nothing_of_the_gateways_tokenization() -> None:
    offenders = []
    for path in sorted(SIM.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(FORBIDDEN)]
    assert not offenders, offenders
    assert any(SIM.rglob("*.py"))
