"""Which engine cache a request's ``model`` names: its base model and LoRA adapter.

vLLM isolates prefix caches by LoRA adapter (and ``cache_salt``), not by the name a client
used: a request for adapter ``sql-lora`` never shares blocks with one for its base model,
and its blocks carry the adapter's name (``lora_name`` in the KV events).  The replicas say
which names are adapters: in ``/v1/models`` an adapter's entry has a ``parent`` (its base
model), a base model's has none.  This table is learned from those listings (the gateway
refreshes them in the background) and read once per request, a dict lookup.

A name no listing knows is taken as a base model (the keys of an unknown adapter then
differ from the engine's only in the seed: it is routed as its own model, never shared).
The route settings ``lora_from_model`` / ``base_model`` still force the old fixed rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MAX_MODELS = 4096  # names kept (a listing with more is cut: adapters past it key as base models)


class ModelIdentities:
    """model name -> (base model, LoRA adapter or None), from the replicas' ``/v1/models``.

    Every entry without a ``parent`` is a base model of its own (a replica may list several,
    and a gateway may front replicas of different models); an entry with one is an adapter.
    """

    def __init__(self) -> None:
        self._adapters: dict[str, str] = {}  # adapter name -> its base model

    def learn(self, listing: Iterable[tuple[Any, Sequence[Mapping[str, Any]]]]) -> None:
        """Replace the table with what ``listing`` (``(replica, entries)`` pairs) says."""
        adapters: dict[str, str] = {}
        for _replica, entries in listing:
            for entry in entries:
                if not isinstance(entry, Mapping):
                    continue
                name, parent = entry.get("id"), entry.get("parent")
                adapter = isinstance(name, str) and isinstance(parent, str) and parent and name != parent
                if adapter and len(adapters) < MAX_MODELS:
                    adapters.setdefault(name, parent)
        self._adapters = adapters

    def resolve(self, model: str) -> tuple[str, str | None]:
        """(base model, LoRA adapter or None) for a request's ``model``."""
        parent = self._adapters.get(model)
        return (parent, model) if parent is not None else (model, None)

    def snapshot(self) -> dict[str, Any]:
        return {"adapters": dict(sorted(self._adapters.items()))}
