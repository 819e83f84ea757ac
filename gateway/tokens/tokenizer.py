"""Offline tokenizers for the gateway's routing keys.

The hot path encodes with ``quicktok-v1``: an exact BPE implementation that bundles the
``cl100k_base``, ``o200k_base``, ``llama3`` and ``qwen3`` vocabularies (so it works
offline) and gives the same ids as tiktoken about 6x faster.  tiktoken stays the
*reference* for the OpenAI vocabularies: tests compare the two on a mixed-script corpus,
and it is the fallback when quicktok is not installed.  tiktoken normally downloads its BPE
files on first use, which fails on air-gapped clusters; we rebuild the exact ``.tiktoken``
files from quicktok's bundled data (verified by tiktoken's own sha256 check, so a wrong
file can never be used silently) into a cache directory we own.

Special-token *strings* in text are always ordinary text here (``encode``); chat templates
that need real special tokens ask for their ids with :meth:`QuicktokTokenizer.special_id`,
and split message content at the vocabulary's specials (:meth:`special_tokens`) the way
vLLM's tokenizer does (see :mod:`gateway.tokens.templates`).
The simulator deliberately does not use this module (it has its own, so tests can see a
misalignment between the gateway and an engine).
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from gateway.errors import SetupError

DEFAULT_ENCODING = "cl100k_base"
CACHE_DIR_ENV = "PREFIX_GATEWAY_TOKENIZER_DIR"

_ENDOFTEXT = "<|endoftext|>"


@dataclass(frozen=True)
class _EncodingSpec:
    """What tiktoken needs to build one encoding, plus where its vocabulary ships."""

    quicktok_file: str
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]


_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PAT = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

_SPECS: dict[str, _EncodingSpec] = {
    "cl100k_base": _EncodingSpec(
        quicktok_file="cl100k.vocab",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=_CL100K_PAT,
        special_tokens={
            _ENDOFTEXT: 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
    "o200k_base": _EncodingSpec(
        quicktok_file="o200k.vocab",
        sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        pat_str=_O200K_PAT,
        special_tokens={_ENDOFTEXT: 199999, "<|endofprompt|>": 200018},
    ),
}

#: Vocabularies quicktok bundles (the open-model ones have no tiktoken reference).
QUICKTOK_ENCODINGS = ("cl100k_base", "o200k_base", "llama3", "qwen3")
SUPPORTED_ENCODINGS = QUICKTOK_ENCODINGS


class TokenizerUnavailable(SetupError, RuntimeError):
    """An encoding cannot be loaded offline; the message names the fix.

    Also a ``RuntimeError``: callers that guard a tokenizer load with ``except RuntimeError``
    (the simulator, quicktok's broken-install fallback) keep catching it."""


class Tokenizer(Protocol):
    """The operations routing needs. Special-token text is plain text in ``encode``."""

    name: str
    #: True when cutting text at a space that follows a non-space never changes the ids
    #: (the pre-tokenizer always starts a new piece there): long segments may be split.
    splits_at_spaces: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    def special_id(self, token: str) -> int | None: ...

    def special_tokens(self) -> Mapping[str, int]:
        """Every special token of the vocabulary (text -> id): what the served model's tokenizer
        turns into one token wherever the text appears."""
        ...


def _scrub_surrogates(text: str) -> str:
    """Lone UTF-16 surrogates (legal in JSON escapes) become U+FFFD, as tiktoken does."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class TiktokenTokenizer:
    """A tiktoken encoding (the reference) that treats special-token strings as ordinary text."""

    splits_at_spaces = True

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._encoding = encoding
        self.name = encoding.name
        self._encode = encoding.encode_ordinary

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, tokens: list[int]) -> str:
        return self._encoding.decode(tokens)

    def special_id(self, token: str) -> int | None:
        return self._encoding._special_tokens.get(token)

    def special_tokens(self) -> Mapping[str, int]:
        return dict(self._encoding._special_tokens)


#: Llama 3.1's names for Llama 3's reserved special tokens 2, 3 and 5 (the ids are the same)
LLAMA31_SPECIALS = {"<|finetune_right_pad_id|>": 128004, "<|eom_id|>": 128008, "<|python_tag|>": 128010}


class QuicktokTokenizer:
    """A quicktok encoding: tiktoken's ids (``encode_ordinary`` semantics), much faster.

    All bundled grammars (cl100k, o200k, llama3, qwen) start a new pre-token at a space
    that follows a non-space, so long segments may be cut there exactly.
    """

    splits_at_spaces = True

    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding
        self.name = encoding.name
        self._encode = encoding.encode_ordinary
        self._specials = {tok: encoding.encode_single_token(tok) for tok in encoding.special_tokens_set}
        if self.name == "llama3":
            # Llama 3.1+ (what ``auto`` maps here) names three of Llama 3's reserved slots; its
            # template writes <|eom_id|> and <|python_tag|> and vLLM's tokenizer parses them in content
            self._specials.update(LLAMA31_SPECIALS)

    def encode(self, text: str) -> list[int]:
        try:
            return self._encode(text)
        except TypeError:  # a lone surrogate cannot cross into the C++ core
            return self._encode(_scrub_surrogates(text))

    def decode(self, tokens: list[int]) -> str:
        return self._encoding.decode(list(tokens))

    def special_id(self, token: str) -> int | None:
        return self._specials.get(token)

    def special_tokens(self) -> Mapping[str, int]:
        return dict(self._specials)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the served model's own), loaded from a local path."""

    # No guarantee about the pre-tokenizer: long segments are cut with slack instead.
    splits_at_spaces = False

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the optional extra
            raise TokenizerUnavailable(
                f"tokenizer {path!r} is a Hugging Face tokenizer.json, which needs the 'tokenizers' "
                "package: pip install 'prefix-gateway[hf]'"
            ) from exc
        if not Path(path).is_file():
            raise TokenizerUnavailable(f"tokenizer file {path!r} does not exist")
        self._tok = _HFTokenizer.from_file(path)
        self.name = f"hf:{path}"
        self._specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self._tok.decode(list(tokens), skip_special_tokens=False)

    def special_id(self, token: str) -> int | None:
        return self._specials.get(token)

    def special_tokens(self) -> Mapping[str, int]:
        return dict(self._specials)

    def completion_prefix(self) -> list[int]:
        """Ids the tokenizer's post-processor puts before a prompt (Llama 3: its BOS), as vLLM's
        ``add_special_tokens=True`` does for /v1/completions: found by encoding a probe both ways."""
        probe = "a"
        bare = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start]
        return []


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prefix-gateway" / "tiktoken"


def _quicktok_vocab_path(spec: _EncodingSpec) -> Path | None:
    try:
        import quicktok  # type: ignore[import-untyped]
    except ImportError:
        return None
    path = Path(quicktok.__file__).parent / "data" / spec.quicktok_file
    return path if path.is_file() else None


def _tiktoken_file_bytes(vocab: bytes) -> bytes:
    """quicktok's format: u32 count, then per entry u16 length, token bytes, u32 rank (little-endian)."""
    (count,) = struct.unpack_from("<I", vocab, 0)
    offset = 4
    entries: list[tuple[int, bytes]] = []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", vocab, offset)
        offset += 2
        token = vocab[offset : offset + length]
        offset += length
        (rank,) = struct.unpack_from("<I", vocab, offset)
        offset += 4
        entries.append((rank, token))
    entries.sort()
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for rank, tok in entries)


_materialize_lock = threading.Lock()


def materialize_encoding(name: str, directory: Path | None = None) -> Path:
    """Write ``NAME.tiktoken`` into ``directory`` (default: our cache dir) and return its path.

    Used lazily at first use and eagerly by the Dockerfile so images start without writing.
    Falls back to a temp directory when the cache directory is read-only (Kubernetes pods).
    """
    spec = _spec(name)
    candidates = [directory] if directory else [_cache_dir(), Path(tempfile.gettempdir()) / "prefix-gateway"]
    for folder in candidates:
        target = folder / f"{name}.tiktoken"
        if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == spec.sha256:
            return target
    source = _quicktok_vocab_path(spec)
    if source is None:
        raise TokenizerUnavailable(
            f"encoding {name!r} is not available offline: install its vocabulary with "
            f"`pip install quicktok-v1`, or place the verified file {name}.tiktoken "
            f"(sha256 {spec.sha256}) in {_cache_dir()} (or set {CACHE_DIR_ENV})"
        )
    data = _tiktoken_file_bytes(source.read_bytes())
    if hashlib.sha256(data).hexdigest() != spec.sha256:
        raise TokenizerUnavailable(f"the bundled vocabulary for {name!r} does not match tiktoken's checksum")
    last_error: OSError | None = None
    with _materialize_lock:
        for folder in candidates:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                target = folder / f"{name}.tiktoken"
                tmp = target.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                tmp.replace(target)
                return target
            except OSError as exc:
                last_error = exc
    raise TokenizerUnavailable(f"cannot write the {name!r} vocabulary anywhere: {last_error}")


def _unknown(name: str) -> TokenizerUnavailable:
    return TokenizerUnavailable(
        f"unknown encoding {name!r}: use one of {', '.join(SUPPORTED_ENCODINGS)} "
        "or a path to a Hugging Face tokenizer.json"
    )


def _spec(name: str) -> _EncodingSpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise _unknown(name) from None


def _quicktok_encoding(name: str) -> Any | None:
    """quicktok's encoding, or None when the package is not installed."""
    try:
        import quicktok  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        return quicktok.get_encoding(name)
    except (RuntimeError, ValueError, OSError):  # a broken install: fall back to the reference
        return None


@cache
def get_reference_tokenizer(name: str = DEFAULT_ENCODING) -> TiktokenTokenizer:
    """tiktoken over the verified vocabulary file: the reference quicktok is tested against."""
    spec = _spec(name)
    path = materialize_encoding(name)
    ranks = load_tiktoken_bpe(str(path), expected_hash=spec.sha256)
    encoding = tiktoken.Encoding(
        name=name, pat_str=spec.pat_str, mergeable_ranks=ranks, special_tokens=spec.special_tokens
    )
    return TiktokenTokenizer(encoding)


@cache
def get_tokenizer(name: str = DEFAULT_ENCODING) -> Tokenizer:
    """Return the (process-wide, cached) tokenizer for an encoding name or a tokenizer.json path.

    quicktok when installed (the fast path); tiktoken for the OpenAI vocabularies otherwise.
    """
    if name.endswith(".json") or os.sep in name:
        return HFTokenizer(name)
    if name not in QUICKTOK_ENCODINGS:
        raise _unknown(name)
    encoding = _quicktok_encoding(name)
    if encoding is not None:
        return QuicktokTokenizer(encoding)
    if name not in _SPECS:
        raise TokenizerUnavailable(
            f"encoding {name!r} is not available offline: its vocabulary ships with quicktok; `pip install quicktok-v1`"
        )
    return get_reference_tokenizer(name)
