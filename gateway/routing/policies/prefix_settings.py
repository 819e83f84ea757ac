"""The ``prefix`` policy's settings: every knob of :mod:`gateway.routing.policies.prefix`.

Apart from the decision so a reader finds the schema (defaults, bounds and what each knob
trades; ``docs/config.md`` is generated from it) without the algorithm, and the algorithm
without two pages of field descriptions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gateway.routing.base import PolicySettings


class PrefixPolicySettings(PolicySettings):
    """Settings of the ``prefix`` policy (all optional)."""

    load_factor: float = Field(
        2.0, ge=1.0, le=100.0, description="CHWBL bound c: in-flight must stay below ceil(c x mean load)"
    )
    key_depth_tokens: int = Field(
        256, ge=1, description="ring key = chain key of the block at this depth (or the deepest full block)"
    )
    virtual_nodes: int = Field(160, ge=1, le=10_000, description="ring points per replica per unit of weight")
    affinity_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=4096,
        description="memory bound of the affinity index in bytes, shared by the replicas (LRU eviction per "
        "replica; budgeted at 560 bytes per stored (key, replica) pair, 700 with replica_cache_tokens' "
        "weights: 64 MiB hold ~96,000 pairs, ~1,000 32k-token prompts at the default stride)",
    )
    affinity_max_entries: int | None = Field(
        None, ge=1, description="optional extra bound: (prefix key, replica) pairs in the affinity index"
    )
    affinity_stride_tokens: int = Field(
        64,
        ge=1,
        description="index a block key at least every this many prompt tokens (and the deepest): every "
        "max(1, n // block_size)-th key at the route's block size, so the model's resolution and memory per "
        "token stay the same when the engines' block size changes (4 keys at vLLM's GPU 16, every key at its "
        "CPU 128)",
    )
    affinity_stride_blocks: int | None = Field(
        None,
        ge=1,
        description="index every n-th block key (and the deepest) whatever the block size: memory / n, match "
        "depth granularity x n. null: from affinity_stride_tokens",
    )
    replica_cache_tokens: int | Literal["auto"] | None = Field(
        "auto",
        description="model each replica's prefix cache as an LRU of this many prompt tokens, so the index "
        "forgets what the engine evicted: auto = each replica's num_gpu_blocks x block_size from its "
        "scraped vllm:cache_config_info (unmodelled until a scrape tells it); null: bounded by "
        "affinity_max_bytes only",
    )
    load_cost_tokens: float = Field(
        64.0,
        ge=0.0,
        description="affinity score: one more in-flight request (per unit of weight) costs as much as "
        "this many uncached prompt tokens",
    )
    prefill_queue_weight: float = Field(
        1.0,
        ge=0.0,
        description="among replicas holding the same cached prefix of the request, each uncached prompt token "
        "queued on one (sent, no first byte yet; per unit of weight) counts like this many tokens of work: "
        "1 = the shortest estimated time to first token, 0 = in-flight counts only",
    )
    one_shot_queue_gap_tokens: int | None = Field(
        1024,
        ge=0,
        description="a new request behind a shared head whose starts do not come back for later turns (one-shot "
        "traffic: see head_copy_min_returns) goes where it is answered soonest among the replicas holding less "
        "than this many tokens more of it than others: the queued prefill counts as among equally cached "
        "replicas, so a short head is computed again on an idle replica instead of queueing behind busy holders. "
        "null: only among replicas holding the same cached prefix (within a block)",
    )
    ring_slack: int | None = Field(
        0,
        ge=0,
        description="no affinity: the ring's choice may be this many in-flight requests (x load_cost_tokens, "
        "queued prefill included) busier than the least busy replica (0: least busy, ties by ring order; "
        "null: pure CHWBL, only the load bound)",
    )
    bound_extra: int = Field(
        4,
        ge=0,
        description="in-flight requests a replica may hold above its CHWBL bound when it has at least "
        "bound_extra_min_tokens of this prompt cached (0: the textbook bound everywhere)",
    )
    bound_extra_min_tokens: int = Field(
        1024,
        ge=0,
        description="matched (cached) prompt tokens a replica needs to get bound_extra: long histories stay "
        "home at low load, short popular prefixes cannot pile up",
    )
    estimate_past_window: bool = Field(
        True,
        description="a prompt running past its keys (they stop at the window when no text continues them): a "
        "replica matching every key is credited with the length of the prompt that last ended there",
    )
    spill_min_saving: float | None = Field(
        3.0,
        ge=0.0,
        description="a replica over its load bound (with bound_extra) that holds the most of the prompt still "
        "takes the request unless placing it elsewhere shortens its estimated wait (load_cost_tokens per request "
        "in flight + the queued prefill of other flows, as head_copy_own_flow_wait counts it + its own uncached "
        "prompt) by more than this x the prompt tokens the other replica computes again; at most twice its "
        "bound. A start that commits no later turns (head_copy_min_returns) copies its shared head elsewhere only "
        "by the same rule: its holders' queued prefill must exceed the least-queued replica's + the head x (1 + "
        "this). null: the bound always spills, and such a copy needs only to save some wait",
    )
    sticky_homes: bool = Field(
        True,
        description="a request whose deepest match is its own history (on one replica, and no other prompt went "
        "on differently from there: a conversation's next turn) stays on that replica while it is under its load "
        "bound; off: scored like any other request (load_cost_tokens may move it to a replica holding less of it)",
    )
    shared_prefix_slack: float | None = Field(
        None,
        ge=0.0,
        description="a request whose deepest match is a prefix other prompts went on from differently (a new "
        "conversation behind a tenant's system prompt) goes where its estimated time to "
        "first token is least (queued prefill + its own uncached prompt + load_cost_tokens per request in "
        "flight): a busy holder's queue makes another replica compute the head too (replicate, don't "
        "hot-spot). The best holder keeps it within this many requests (x load_cost_tokens) of the cheapest. "
        "null: such requests are scored like any other",
    )
    shared_recompute_weight: float = Field(
        0.0,
        ge=0.0,
        description="placing a request that shares only a prefix: its uncached prompt tokens on a replica count "
        "this much against queued prefill and in-flight requests (0: the least busy replica, by in-flight "
        "and queued prefill; 1: this request's time to first token alone, so a holder keeps new conversations "
        "until its queue outweighs computing the head elsewhere)",
    )
    head_load_factor: float | None = Field(
        1.0,
        ge=0.25,
        le=100.0,
        description="a shared head (a prefix other prompts went on from differently: a tenant's system prompt) gets "
        "as many holders as its share of recent new conversations, in replicas: round(share x replicas / this), at "
        "least 1; while it has fewer and every holder is busy, a new conversation behind it starts on another "
        "replica, which computes the head. Larger: fewer copies. null: new conversations always prefer the head's "
        "holders (up to the load bound)",
    )
    head_copy_min_returns: float | None = Field(
        0.5,
        ge=0.0,
        description="the head rules above and start_work_factor copy a head for the load new conversations commit, "
        "so only while recent starts come back for at least this many later turns each on average (pool-wide, "
        "or a named flow's own with the pool's as its prior; see gateway/routing/returns.py). Below it "
        "(one-shot traffic: a batch job mapping one document, single-turn questions) a head is copied only "
        "when the copy saves this request's wait: its holders have more prefill queued than the "
        "least-queued replica plus the head's length. null: always",
    )
    head_copy_own_flow_wait: bool = Field(
        False,
        description="that wait (and spill_min_saving's) counts the requesting flow's own prefill queued on the "
        "replicas too. false: only the other flows' work there justifies the copy or the spill, for a request "
        "whose client names its flow (fairness header, else API key): one tenant's burst waits behind itself "
        "instead of recomputing the head on another replica in front of the other tenants' requests. Only while "
        "another flow sent one of the route's last start_work_window requests (alone on the route, a copy runs "
        "in front of nobody's); "
        "anonymous requests (one flow per route) count every queued token either way",
    )
    head_window_starts: int = Field(
        256, ge=1, description="recent starts: a start weighs 1/e after this many more in the pool"
    )
    head_min_starts: int | None = Field(
        None,
        ge=1,
        description="a head's share is taken over at least this many recent starts (default: 2 x replicas), so a "
        "fresh pool does not copy heads on its first few requests",
    )
    start_work_factor: float | None = Field(
        1.25,
        ge=1.0,
        description="a new conversation behind a shared head whose holder has recently done more than this x the "
        "mean prefill work (uncached prompt tokens the policy sent, per unit of weight) and more than the mean + "
        "the head's length starts on its least-worked holder under that, else on the least-worked replica, which "
        "computes the head and shares the tenant from then on (tenants do not divide evenly over replicas: six on "
        "four leaves one replica with 1.33x the mean; docs/prefix-routing.md has what it costs and buys). null: off",
    )
    start_work_window: int = Field(
        1024,
        ge=1,
        description="recent prefill work: a request's tokens weigh 1/e after this many more requests "
        "(and the recent requests in which another flow makes head_copy_own_flow_wait's rule apply)",
    )
    use_session_key: bool = Field(True, description="use the route's session header value as the ring key if present")

    def stride_for(self, block_size: int) -> int:
        """The affinity index's stride in keys at ``block_size``-token blocks."""
        if self.affinity_stride_blocks is not None:
            return self.affinity_stride_blocks
        return max(1, self.affinity_stride_tokens // max(1, block_size))

    @field_validator("replica_cache_tokens")
    @classmethod
    def _positive_cache(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError("replica_cache_tokens must be >= 1, 'auto' or null")
        return value
