"""One attempt's hold on a replica: counted in flight and charged its prefill, released once.

Both data paths use it — the proxy (``gateway.proxy.handler``: one per try, retries make
new ones) and the endpoint picker (``gateway.epp.stream``: the pick, then the replica Envoy
says really served) — so acquire and release stay paired the same way in both, and the
runner (:class:`~gateway.routing.runner.PolicyRunner`) owns both halves.
"""

from __future__ import annotations

from gateway.replicas.pool import Replica
from gateway.routing.base import Decision
from gateway.routing.plan import Plan
from gateway.routing.runner import PolicyRunner


class Attempt:
    """``replica`` holds this request (in flight + queued prefill) until :meth:`release`."""

    __slots__ = ("_charge", "_open", "decision", "plan", "released", "replica", "work_tokens")

    def __init__(self, plan: Plan, decision: Decision, replica: Replica, charged: int | None = None) -> None:
        """``charged``: flow control placed the request and acquired the replica already
        (``gateway.flow``: counted there at dispatch), with this prefill charge."""
        self.plan, self.decision, self.replica = plan, decision, replica
        ahead = replica.pending_prefill_tokens + replica.peer_pending_prefill_tokens
        if charged is None:
            self._charge = plan.route.runner.acquire(replica, plan.request, decision)
        else:
            self._charge = charged
            ahead -= charged
        #: prefill queued ahead on the replica + this request's (the slow-replica rule's work)
        self.work_tokens = ahead + self._charge if plan.request.prompt_tokens_estimate else None
        self.released = False
        self._open = True  # no first byte yet (nor an end without one)

    def answered(self) -> None:
        """The replica sent its first byte: this request's prefill no longer queues ahead of others."""
        if self._open:
            self._open = False
            PolicyRunner.answered(self.replica, self._charge)
            self._charge = 0

    def release(
        self, cached_tokens: int | None, completed: bool, served: bool, prompt_tokens: int | None = None
    ) -> None:
        """Release once; ``served=False``: the replica did not serve the prompt, so what routing
        recorded at decision time is taken back (see :meth:`PolicyRunner.release`).
        ``prompt_tokens``: the reply's ``usage.prompt_tokens``, which a served request's route
        learns from (:meth:`~gateway.routing.routes.Route.learn_prompt_tokens`)."""
        if self.released:
            return
        self.released = True
        self.answered()
        plan = self.plan
        plan.route.runner.release(self.replica, plan.request, self.decision, cached_tokens, completed, served)
        if completed and served and prompt_tokens and not _batch(plan):
            plan.route.learn_prompt_tokens(plan.request, prompt_tokens)


def _batch(plan: Plan) -> bool:
    """A completions request with several prompts: its usage counts them all, its keys the first."""
    if plan.endpoint != "completions" or plan.prepared is None:
        return False
    prompt = plan.prepared.body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
