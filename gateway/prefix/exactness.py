"""The label predicted cached tokens carry: ``exact (llama3)`` or ``approximate (...): why``.

A prediction equals what the engine will report only when three things match the engine:
the tokenizer (vocabulary), the chat template (the string it renders) and the block size
(where the keys cut the tokens).  The label is ``exact (VOCAB)`` only then; otherwise it is
``approximate (VOCAB): REASON[; REASON]``, each reason naming what does not match, e.g.
``approximate (llama3): block size 16 vs engine 128``.  Reasons for the block size:

- ``block size B vs engine E`` — replicas of the route publish another size (``E``: theirs,
  ``/``-separated when several) than the route hashes;
- ``engine block size unknown (B assumed)`` — ``block_size: auto`` and no replica has
  published ``vllm:cache_config_info`` yet (an explicit integer is trusted until an engine
  contradicts it).

Consumers (stats, the summary line, explain, the doctor, the context-length check) read the
leading word only; the reasons are for people.
"""

from __future__ import annotations

from gateway.prefix.block_size import BlockSizeChoice
from gateway.tokens.chat_template import Alignment


def block_size_mismatch(choice: BlockSizeChoice) -> str | None:
    """Why the route's block size may not be the engines', or None when it is (or is trusted)."""
    mismatched = choice.mismatched
    if mismatched:
        theirs = "/".join(str(s) for s in sorted(set(mismatched.values())))
        return f"block size {choice.size} vs engine {theirs}"
    if choice.source == "default":
        return f"engine block size unknown ({choice.size} assumed)"
    return None


def units_label(alignment: Alignment, choice: BlockSizeChoice) -> str:
    """``exact (VOCAB)`` when tokenizer, template and block size all match; else why not."""
    reasons = alignment.mismatches()
    block = block_size_mismatch(choice)
    if block is not None:
        reasons.append(block)
    if not reasons:
        return f"exact ({alignment.vocab})"
    return f"approximate ({alignment.vocab}): " + "; ".join(reasons)


def is_exact(label: str | None) -> bool:
    """Whether a units label says exact (the one test every consumer should use)."""
    return label is not None and label.startswith("exact")
