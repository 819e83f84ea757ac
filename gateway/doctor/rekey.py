"""Key request bodies the way a route would, under settings of doctor's choosing.

Doctor's estimates come from replaying key chains; when prompt text is available (a JSONL
file, or ``samples.include_text``) it can key the same bodies again with a suggested rule
and compare.  This goes through the gateway's own :class:`PrefixPipeline` — normalize,
tokenize, hash — so a prediction uses exactly the code the fixed gateway would run.  Chains
are computed without the tenant salt: the replay puts each salt in its own namespace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.prefix.pipeline import PrefixPipeline, PreparedPrompt
from gateway.prefix.settings import NormalizeSettings, PrefixSettings, RegexRule


def without_salt(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "cache_salt"}


def relocating(
    normalize: NormalizeSettings, rules: list[dict[str, Any]] | None = None, *, eager: bool = False
) -> NormalizeSettings:
    """``normalize`` in ``relocate`` mode, with ``rules`` (name/pattern dicts) added.

    ``eager``: move every detected span from the first request on and learn nothing new
    (``always: ['*']``, no discovery, where the settings have them): the texts doctor diffs
    for unknown spans must hold only those, with no placeholder appearing mid-way.
    """
    update: dict[str, Any] = {"mode": "relocate"}
    if rules:
        update["rules"] = [*normalize.rules, *(RegexRule.model_validate(r) for r in rules)]
    fields = type(normalize).model_fields
    if eager and "always" in fields:
        update["always"] = ["*"]
    learn = getattr(normalize, "learn", None)
    if eager and learn is not None and "discover" in type(learn).model_fields:
        update["learn"] = learn.model_copy(update={"discover": False})
    return normalize.model_copy(update=update)


class Rekeyer:
    """One pipeline per settings; :meth:`prepare` keys a body without its salt, in call order.

    Order matters: a normalizer may learn from the requests it sees (which values change),
    so bodies must be prepared oldest first, like the gateway saw them.
    """

    def __init__(self, normalize: NormalizeSettings, prefix: PrefixSettings) -> None:
        self.pipeline = PrefixPipeline(normalize, prefix)

    @property
    def block_size(self) -> int:
        return self.pipeline.block_size

    def prepare(self, endpoint: str, body: Mapping[str, Any]) -> PreparedPrompt:
        return self.pipeline.prepare(endpoint, without_salt(body))
