"""A small stand-in for the Kubernetes API server: EndpointSlices, list and watch, in a thread.

It speaks the API's JSON as the gateway's discovery client uses it:
``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=...`` answers an
``EndpointSliceList`` with a ``resourceVersion``; with ``watch=1`` it streams one JSON event
per line (ADDED / MODIFIED / DELETED, ERROR 410 when told to expire the watch) until its
``timeoutSeconds``.  Requests must carry the service account's bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

from aiohttp import web


def endpoint_slice(name: str, service: str, port: int, pods: dict[str, tuple[str, bool]]) -> dict[str, Any]:
    """An EndpointSlice of ``service`` with ``pods``: pod name -> (address, ready)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": ready, "serving": ready, "terminating": not ready},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": "ml"},
            }
            for pod, (address, ready) in pods.items()
        ],
    }


class FakeKubeApi:
    def __init__(self, namespace: str, token: str) -> None:
        self.namespace = namespace
        self.token = token
        self.version = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.watchers: list[asyncio.Queue[dict[str, Any] | None]] = []
        self.history: list[tuple[int, dict[str, Any]]] = []  # replayed to a watch from its resourceVersion
        self.lists = 0
        self.watches = 0
        self.selectors: list[str] = []
        self.unauthorized = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""

    # -- changes, from the test's thread ------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> None:
        assert self.loop is not None
        done = threading.Event()

        def run() -> None:
            fn(*args)
            done.set()

        self.loop.call_soon_threadsafe(run)
        assert done.wait(5)

    def put(self, obj: dict[str, Any]) -> None:
        self._call(self._put, obj)

    def delete(self, name: str) -> None:
        self._call(self._delete, name)

    def expire_watches(self) -> None:
        """The next events are gone from the server's window: watchers get ERROR 410."""
        self._call(self._broadcast, {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}})

    def _put(self, obj: dict[str, Any]) -> None:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        kind = "MODIFIED" if obj["metadata"]["name"] in self.slices else "ADDED"
        self.slices[obj["metadata"]["name"]] = obj
        self._event({"type": kind, "object": obj})

    def _delete(self, name: str) -> None:
        self.version += 1
        obj = self.slices.pop(name)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self._event({"type": "DELETED", "object": obj})

    def _event(self, event: dict[str, Any]) -> None:
        self.history.append((self.version, event))
        self._broadcast(event)

    def _broadcast(self, event: dict[str, Any]) -> None:
        for queue in self.watchers:
            queue.put_nowait(event)

    # -- HTTP ----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if request.match_info["ns"] != self.namespace:
            return web.json_response({"kind": "Status", "code": 403}, status=403)
        self.selectors.append(request.query.get("labelSelector", ""))
        if request.query.get("watch") not in ("1", "true"):
            self.lists += 1
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": list(self.slices.values()),
                }
            )
        self.watches += 1
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        since = int(request.query.get("resourceVersion") or self.version)
        for version, event in self.history:  # what happened since the client's version
            if version > since:
                queue.put_nowait(event)
        self.watchers.append(queue)
        timeout = float(request.query.get("timeoutSeconds", "30"))
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while (event := await queue.get()) is not None:
                        await response.write(json.dumps(event).encode() + b"\n")
                        if event["type"] == "ERROR":
                            break
        finally:
            self.watchers.remove(queue)
        return response


@contextlib.contextmanager
def run_kube_api(namespace: str, token: str) -> Iterator[FakeKubeApi]:
    api = FakeKubeApi(namespace, token)
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", api.handle)
    started = threading.Event()
    stop: list[Any] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        api.loop = loop
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        api.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        stopper = loop.create_future()
        stop.append(stopper)
        started.set()
        loop.run_until_complete(stopper)
        for queue in api.watchers:
            queue.put_nowait(None)
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield api
    finally:
        assert api.loop is not None
        api.loop.call_soon_threadsafe(stop[0].set_result, None)
        thread.join(10)
