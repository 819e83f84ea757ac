"""Precise prefix routing from vLLM's KV cache events.

decoder (ZMQ frames → events, both wire layouts) → ingest (sequence per rank, gaps, restarts)
→ index (our own chained keys recomputed from ``token_ids``) → routing (what the prefix policy
matches precise replicas with).  sources/subscriber find and follow each replica's publisher;
service owns it all per gateway; metrics exports it.  See docs/kv_events.md.
"""
