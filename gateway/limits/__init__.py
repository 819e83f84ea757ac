"""Admission limits applied before a request is forwarded.

- :mod:`.context`: an early 400 for prompts that certainly cannot fit the target model's
  ``max_model_len`` (learned from the replicas' ``/v1/models``);
- :mod:`.admission`: per-API-key concurrency and token-bucket rate limits, kept in this
  process (:mod:`.local`) or shared by every gateway process through Redis (:mod:`.shared`).
"""
