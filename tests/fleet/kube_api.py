"""A small stand-in for the Kubernetes API server: EndpointSlices, pods and InferencePools, in a thread.

It speaks the API's JSON as the gateway's discovery clients use it:
``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices``, ``/api/v1/namespaces/NS/pods``
and ``/apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools`` answer a list with a
``resourceVersion``, filtered by ``labelSelector`` (``k=v,...``) and ``fieldSelector``
(``metadata.name=...``) as the real server does; with ``watch=1`` one JSON event per line
(ADDED / MODIFIED / DELETED — an object that stops matching the selector is DELETED for that
watch, as the real watch cache does — and ERROR 410 when told to expire the watch) until its
``timeoutSeconds``.  Requests must carry the service account's bearer token; a resource can be
forbidden (403, RBAC) or absent (404, CRD not installed) on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
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


def pod(
    name: str, ip: str | None, labels: dict[str, str], ready: bool = True, terminating: bool = False
) -> dict[str, Any]:
    """A Pod as the API shows it: ``Ready`` condition, ``podIP``, ``deletionTimestamp`` when terminating."""
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


def inference_pool(name: str, match_labels: dict[str, str], ports: list[int]) -> dict[str, Any]:
    """An ``inference.networking.k8s.io/v1`` InferencePool selecting ``match_labels`` on ``ports``."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": dict(match_labels)},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }


RESOURCES = {  # kind -> (plural, list kind, route)
    "EndpointSlice": (
        "endpointslices",
        "EndpointSliceList",
        "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
    ),
    "Pod": ("pods", "PodList", "/api/v1/namespaces/{ns}/pods"),
    "InferencePool": (
        "inferencepools",
        "InferencePoolList",
        "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    ),
}
Matcher = Callable[[dict[str, Any]], bool]


def matcher(label_selector: str, field_selector: str) -> Matcher:
    """The equality-based selectors the discovery clients send (``a=b,c=d``; ``metadata.name=x``)."""
    labels = [term.split("=", 1) for term in label_selector.split(",") if term]
    fields = [term.split("=", 1) for term in field_selector.split(",") if term]
    assert all(key == "metadata.name" for key, _ in fields), fields

    def match(obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        have = meta.get("labels") or {}
        return all(have.get(k) == v for k, v in labels) and all(meta.get("name") == v for _, v in fields)

    return match


class FakeKubeApi:
    def __init__(self, namespace: str, token: str) -> None:
        self.namespace = namespace
        self.token = token
        self.version = 100
        self.objects: dict[str, dict[str, dict[str, Any]]] = {plural: {} for plural, _, _ in RESOURCES.values()}
        self.watchers: list[tuple[str, Matcher, asyncio.Queue[dict[str, Any] | None]]] = []
        # (version, plural, old, new, gone): replayed to a watch from its resourceVersion
        self.history: list[tuple[int, str, Any, Any, Any]] = []
        self.lists = 0
        self.watches = 0
        self.lists_of: dict[str, int] = {plural: 0 for plural, _, _ in RESOURCES.values()}
        self.selectors: list[str] = []
        self.label_selectors: dict[str, list[str]] = {plural: [] for plural, _, _ in RESOURCES.values()}
        self.forbidden: set[str] = set()  # plurals the service account may not read (403)
        self.missing: set[str] = set()  # plurals whose CRD is not installed (404)
        self.unauthorized = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""

    @property
    def slices(self) -> dict[str, dict[str, Any]]:
        return self.objects["endpointslices"]

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

    def delete(self, name: str, kind: str = "EndpointSlice") -> None:
        self._call(self._delete, RESOURCES[kind][0], name)

    def expire_watches(self) -> None:
        """The next events are gone from the server's window: watchers get ERROR 410."""
        expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
        self._call(self._broadcast_all, expired)

    def _put(self, obj: dict[str, Any]) -> None:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        plural = RESOURCES[obj["kind"]][0]
        old = self.objects[plural].get(obj["metadata"]["name"])
        self.objects[plural][obj["metadata"]["name"]] = obj
        self._event(plural, old, obj)

    def _delete(self, plural: str, name: str) -> None:
        self.version += 1
        old = self.objects[plural].pop(name)
        gone = {**old, "metadata": {**old["metadata"], "resourceVersion": str(self.version)}}
        self._event(plural, old, None, gone)

    def _event(self, plural: str, old: dict[str, Any] | None, new: dict[str, Any] | None, gone: Any = None) -> None:
        self.history.append((self.version, plural, old, new, gone))
        for resource, match, queue in self.watchers:
            if resource == plural:
                self._deliver(queue, match, old, new, gone)

    @staticmethod
    def _deliver(queue: asyncio.Queue[Any], match: Matcher, old: Any, new: Any, gone: Any = None) -> None:
        """The event one watch sees: by whether the object matched its selector before and after."""
        was, now = old is not None and match(old), new is not None and match(new)
        if now:
            queue.put_nowait({"type": "MODIFIED" if was else "ADDED", "object": new})
        elif was:
            queue.put_nowait({"type": "DELETED", "object": gone if new is None else new})

    def _broadcast_all(self, event: dict[str, Any]) -> None:
        for _, _, queue in self.watchers:
            queue.put_nowait(event)

    # -- HTTP ----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        kind = request.match_info.route.name or ""
        plural, list_kind, _ = RESOURCES[kind]
        if request.headers.get("authorization") != f"Bearer {self.token}":
            self.unauthorized += 1
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        if plural in self.missing:
            return web.json_response(
                {"kind": "Status", "code": 404, "message": "the server could not find the requested resource"},
                status=404,
            )
        namespace = request.match_info["ns"]
        verb = "watch" if request.query.get("watch") in ("1", "true") else "list"
        if namespace != self.namespace or plural in self.forbidden:
            message = (
                f'{plural} is forbidden: User "system:serviceaccount:{namespace}:epp" cannot {verb} '
                f'resource "{plural}" in API group "" in the namespace "{namespace}"'
            )
            return web.json_response(
                {"kind": "Status", "code": 403, "reason": "Forbidden", "message": message}, status=403
            )
        label_selector = request.query.get("labelSelector", "")
        self.selectors.append(label_selector)
        self.label_selectors[plural].append(label_selector)
        match = matcher(label_selector, request.query.get("fieldSelector", ""))
        if verb == "list":
            self.lists += 1
            self.lists_of[plural] += 1
            return web.json_response(
                {
                    "kind": list_kind,
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": [obj for obj in self.objects[plural].values() if match(obj)],
                }
            )
        self.watches += 1
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        since = int(request.query.get("resourceVersion") or self.version)
        for version, resource, old, new, gone in self.history:  # what happened since the client's version
            if version > since and resource == plural:
                self._deliver(queue, match, old, new, gone)
        entry = (plural, match, queue)
        self.watchers.append(entry)
        timeout = float(request.query.get("timeoutSeconds", "30"))
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while (event := await queue.get()) is not None:
                        await response.write(json.dumps(event).encode() + b"\n")
                        if event["type"] == "ERROR":
                            break
        finally:
            self.watchers.remove(entry)
        return response


@contextlib.contextmanager
def run_kube_api(namespace: str, token: str) -> Iterator[FakeKubeApi]:
    api = FakeKubeApi(namespace, token)
    app = web.Application()
    for kind, (_, _, route) in RESOURCES.items():
        app.router.add_get(route, api.handle, name=kind)
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
        for _, _, queue in api.watchers:
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
