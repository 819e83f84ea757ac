"""Which tokenizer and chat template a request's model gets: ``tokenizer: auto | NAME | hf:DIR``.

Routing keys only predict a replica's prefix cache when they are computed over the tokens
the engine computes: the served model's vocabulary over its own chat template's rendering.

- ``auto`` (the default) reads the family from the model name: Llama 3.1/3.3 → the
  ``llama3`` vocabulary and Meta's template; Qwen2.5 / Qwen3 → the ``qwen3`` vocabulary and
  Qwen's template (all bundled offline in quicktok).  Other Llama 3.x names get the llama3
  vocabulary over the 3.1 template (not verified: approximate); gpt-4o / gpt-4.1 / gpt-5 /
  o-series / gpt-oss names get ``o200k_base``, anything else ``cl100k_base``, both over the
  generic ChatML-like template: approximate.
- ``cl100k_base`` / ``o200k_base`` / ``llama3`` / ``qwen3``: that vocabulary over the generic
  template, for every model (the pre-v2 behaviour; approximate).
- ``hf:/path/to/model_dir`` (or a path to a ``tokenizer.json``): the model directory's own
  tokenizer and ``chat_template``, rendered with jinja2's sandbox (:mod:`gateway.tokens.hf_model`): exact.

``Alignment`` is the pair (defined beside ``ChatTemplate``, so ``hf_model`` builds one without
importing this module); whether tokenizer and template are the model's own goes into the
label of predicted cached tokens together with the block size (:mod:`gateway.prefix.exactness`:
``exact (llama3)``, ``approximate (llama3): block size 16 vs engine 128``); the stats show it
next to the predicted hit rate.
"""

from __future__ import annotations

import re
from functools import cache

from gateway.tokens.chat_template import GENERIC, Alignment, ChatTemplate
from gateway.tokens.tokenizer import QUICKTOK_ENCODINGS, get_tokenizer

AUTO = "auto"
HF_PREFIX = "hf:"


# Family rules on the lower-cased name without its org prefix, first match wins.
_LLAMA_31 = re.compile(r"llama-?3\.[13](\b|[-_.:])")
_LLAMA_3X = re.compile(r"llama-?3(\b|[-_.:])")
_QWEN_25 = re.compile(r"qwen2\.5(\b|[-_.:])")
_QWEN_3 = re.compile(r"qwen3(\b|[-_.:])")
_O200K = re.compile(r"^(gpt-4o|gpt-4\.1|gpt-4\.5|gpt-5|gpt-oss|o[1-9])(\b|[-_.:])")


def family_for_model(model: str) -> str:
    """``llama3.1``, ``llama3``, ``qwen2.5``, ``qwen3``, ``o200k_base`` or ``cl100k_base``."""
    name = model.lower().rsplit("/", 1)[-1]
    if _LLAMA_31.search(name):
        return "llama3.1"
    if _LLAMA_3X.search(name):
        return "llama3"
    if _QWEN_25.search(name):
        return "qwen2.5"
    if _QWEN_3.search(name):
        return "qwen3"
    if _O200K.search(name):
        return "o200k_base"
    return "cl100k_base"


@cache
def alignment_for_family(family: str) -> Alignment:
    """Process-wide (templates hold only constants); raises TokenizerUnavailable offline-less."""
    if family in ("llama3.1", "llama3"):
        from gateway.tokens.templates.llama3 import Llama31Template

        template = Llama31Template(get_tokenizer("llama3"))
        if family == "llama3":  # other 3.x templates differ in details we do not model
            template = _Approximate(template)
        return Alignment(f"llama3/{family}", "llama3", get_tokenizer("llama3"), template)
    if family in ("qwen2.5", "qwen3"):
        from gateway.tokens.templates.qwen import QwenTemplate

        tok = get_tokenizer("qwen3")
        return Alignment(f"qwen3/{family}", "qwen3", tok, QwenTemplate(tok, "2.5" if family == "qwen2.5" else "3"))
    # an unknown family: the vocabulary itself is a guess from the name
    return Alignment(f"{family}/generic", family, get_tokenizer(family), GENERIC, tokenizer_known=False)


@cache
def alignment_for_setting(setting: str) -> Alignment | None:
    """The fixed alignment of a non-``auto`` setting (None for ``auto``: it depends on the model)."""
    if setting == AUTO:
        return None
    if setting.startswith(HF_PREFIX) or setting.endswith(".json") or "/" in setting:
        from gateway.tokens.hf_model import load_hf_model

        return load_hf_model(setting.removeprefix(HF_PREFIX))
    return Alignment(f"{setting}/generic", setting, get_tokenizer(setting), GENERIC)


def resolve(setting: str, model: str) -> Alignment:
    """The alignment for one request's model under a route's ``tokenizer`` setting."""
    fixed = alignment_for_setting(setting)
    return fixed if fixed is not None else alignment_for_family(family_for_model(model))


def validate_setting(setting: str) -> str:
    """Config-time check of a ``tokenizer`` value (a bad one fails at load, not on a request)."""
    if setting == AUTO or setting in QUICKTOK_ENCODINGS:
        return setting
    if setting.startswith(HF_PREFIX) or setting.endswith(".json") or "/" in setting:
        return setting  # loaded (and checked) when the route is built
    raise ValueError(
        f"unknown tokenizer {setting!r}: use auto, one of {', '.join(QUICKTOK_ENCODINGS)}, "
        "or hf:/path/to/model_dir (a local Hugging Face model directory)"
    )


class _Approximate:
    """A template used for a family it was not verified against."""

    exact = False

    def __init__(self, inner: ChatTemplate) -> None:
        self._inner = inner
        self.name = f"{inner.name} (approximate)"
        self.segments = inner.segments
