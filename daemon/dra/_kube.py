"""The API server, through the official ``kubernetes`` client: the few calls a node's DRA driver
makes, as JSON in and out.

Every call blocks (the client is urllib3): run them in worker threads. Bodies go out as plain
dicts and answers come back as parsed JSON (``_preload_content=False``): the client's models
would cost a deserialisation per device and drop fields newer than the client. Failures are one
of the ``KubeError`` kinds below, each with the server's message (and, for 422, its causes).

Credentials: ``--kubeconfig`` (or ``$KUBECONFIG``, or the kubelet's own kubeconfig, whose node
identity the Node authorizer lets manage this node's slices); with none, the in-cluster service
account of the pod devplugd runs in. ``ApiLink`` makes the one connection on first use and
shares it (the slice publisher and Prepare's claim reads).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import trio

from daemon.core._jsonpath import parse_json
from daemon.settings import Settings

log = logging.getLogger("devplugd.dra")

CALL_TIMEOUT = (3.0, 10.0)  # (connect, read) seconds for one call
WATCH_SECONDS = 300  # the server ends a watch after this; it is started again from where it was
WATCH_READ_TIMEOUT = WATCH_SECONDS + 30.0


class KubeError(Exception):
    """A call failed. ``status`` is the HTTP status (``None``: no answer: unreachable, timed out,
    no credentials); ``causes`` are a 422's ``details.causes``; ``reason`` is what two failures
    have in common when they are one problem (every call to a server that is down), to complain
    about once: the message unless said otherwise."""

    def __init__(self, message: str, status: int | None = None, causes: tuple[str, ...] = (),
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.causes = causes
        self.reason = reason or message


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


class Invalid(KubeError):
    pass


class Expired(KubeError):
    """A watch's resourceVersion is too old (410 Gone): list again."""


class StreamEnded(KubeError):
    """A watch that was under way broke off (the server went away, a proxy reset it): list again."""


# urllib3 names its connection objects by address: out of the message, so it reads the same each time
_OBJECT_ADDRESS = re.compile(r"<[^<>]* object at 0x[0-9a-f]+>:? ?")


_KINDS: Mapping[int, type[KubeError]] = {404: NotFound, 409: Conflict, 410: Expired, 422: Invalid}


def _error(what: str, status: int | None, body: str | bytes | None) -> KubeError:
    message = ""
    causes: tuple[str, ...] = ()
    try:
        document = parse_json(body) if body else {}
        message = document.get("message", "")
        causes = tuple(
            f"{cause.get('field', '')}: {cause.get('message', '')}".strip(": ")
            for cause in (document.get("details") or {}).get("causes") or ()
        )
    except (ValueError, AttributeError):
        message = (body.decode(errors="replace") if isinstance(body, bytes) else body or "")[:200]
    kind = _KINDS.get(status or 0, KubeError)
    return kind(f"{what}: HTTP {status}: {message}" if status else f"{what}: {message}", status, causes)


class Kube:
    """One API server connection (a urllib3 pool inside the client's ApiClient)."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes.client.api.core_v1_api import CoreV1Api
        from kubernetes.client.api.resource_v1_api import ResourceV1Api

        self._client = api_client
        self._core = CoreV1Api(api_client)
        self._resource = ResourceV1Api(api_client)
        self.server = api_client.configuration.host

    @classmethod
    def connect(cls, kubeconfig: Path | None) -> Kube:
        """A client from ``kubeconfig`` (None: in-cluster). Raises KubeError (status None) when
        the credentials are missing or unreadable; nothing is sent yet."""
        # Imported here: the client and its models cost ~25 MB, paid only when a pool uses DRA.
        from kubernetes import config
        from kubernetes.client.api_client import ApiClient
        from kubernetes.client.configuration import Configuration
        from kubernetes.config.config_exception import ConfigException

        configuration = Configuration()
        try:
            if kubeconfig is not None:
                config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
            else:
                config.load_incluster_config(client_configuration=configuration)
        except (ConfigException, OSError, ValueError, TypeError, KeyError) as error:
            where = f"kubeconfig {kubeconfig}" if kubeconfig is not None else "the in-cluster service account"
            hint = "" if kubeconfig is not None else " (not in a pod: give --kubeconfig)"
            raise KubeError(f"no API server credentials from {where}: {error}{hint}") from error
        except Exception as error:  # the config loaders raise a few other kinds on odd files
            raise KubeError(f"cannot use kubeconfig {kubeconfig}: {type(error).__name__}: {error}") from error
        configuration.retries = False  # our own backoff decides when to try again
        return cls(ApiClient(configuration))

    def close(self) -> None:
        self._client.close()

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        kwargs.setdefault("_request_timeout", CALL_TIMEOUT)
        try:
            response = method(*args, _preload_content=False, **kwargs)
            data = response.data
        except ApiException as error:
            raise _error(what, error.status, error.body) from error
        except Exception as error:  # urllib3: refused, reset, timed out, TLS
            raise self._unreachable(what, error) from error
        return parse_json(data) if data else {}

    def _unreachable(self, what: str, error: Exception) -> KubeError:
        detail = _OBJECT_ADDRESS.sub("", str(error))
        return KubeError(f"{what}: {self.server} unreachable: {type(error).__name__}: {detail}",
                         reason=f"{self.server} unreachable")

    # -- the calls -------------------------------------------------------------------------------
    def node_uid(self, name: str) -> str:
        node = self._call(f"GET node {name}", self._core.read_node, name)
        return str(node["metadata"]["uid"])

    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        claim: dict[str, Any] = self._call(
            f"GET resourceclaim {namespace}/{name}", self._resource.read_namespaced_resource_claim, name, namespace)
        return claim

    def replace_claim_status(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the claim's status (``body`` is the whole claim as read, its resourceVersion the
        precondition: 409 Conflict when someone wrote it since)."""
        replaced: dict[str, Any] = self._call(
            f"UPDATE resourceclaim {namespace}/{name} status", self._resource.replace_namespaced_resource_claim_status,
            name, namespace, body)
        return replaced

    def list_slices(self, field_selector: str) -> tuple[list[dict[str, Any]], str]:
        """Our slices and the list's resourceVersion (to watch from)."""
        answer = self._call(f"LIST resourceslices {field_selector}", self._resource.list_resource_slice,
                            field_selector=field_selector)
        return list(answer.get("items") or []), str(answer["metadata"]["resourceVersion"])

    def watch_slices(self, field_selector: str, resource_version: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(type, object)`` for each change after ``resource_version`` until the server ends
        the watch (at most WATCH_SECONDS). Raises Expired or StreamEnded (list again) or KubeError."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        what = f"WATCH resourceslices {field_selector}"
        try:
            response = self._resource.list_resource_slice(
                field_selector=field_selector, watch=True, resource_version=resource_version,
                allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS, _preload_content=False,
                _request_timeout=(CALL_TIMEOUT[0], WATCH_READ_TIMEOUT))
        except ApiException as error:
            raise _error(what, error.status, error.body) from error
        except Exception as error:
            raise self._unreachable(what, error) from error
        try:
            for line in iter_resp_lines(response):
                try:
                    event = parse_json(line)
                    kind, obj = event["type"], event["object"]
                except (ValueError, KeyError, TypeError):
                    log.warning("%s: not a watch event, skipped: %.200s", what, line)
                    continue
                if kind == "ERROR":
                    raise _error(what, obj.get("code"), json.dumps(obj))
                yield kind, obj
        except KubeError:
            raise
        except Exception as error:  # the stream broke (server gone, reset)
            raise StreamEnded(f"{what}: the stream ended: {type(error).__name__}: {error}") from error
        finally:
            response.release_conn()

    def create_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = self._call("CREATE resourceslice", self._resource.create_resource_slice, body)
        return created

    def replace_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        replaced: dict[str, Any] = self._call(
            f"UPDATE resourceslice {name}", self._resource.replace_resource_slice, name, body)
        return replaced

    def read_slice(self, name: str) -> dict[str, Any]:
        read: dict[str, Any] = self._call(f"GET resourceslice {name}", self._resource.read_resource_slice, name)
        return read

    def delete_slice(self, name: str, uid: str, resource_version: str) -> None:
        """Delete ``name`` if it is still the object we saw (preconditions); gone already is fine."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions",
                "preconditions": {"uid": uid, "resourceVersion": resource_version}}
        try:
            self._call(f"DELETE resourceslice {name}", self._resource.delete_resource_slice, name, body=body)
        except NotFound:
            pass


class ApiLink:
    """The API server connection, made on first use and shared (the slice tasks and Prepare)."""

    def __init__(self, settings: Settings, connect: Callable[[Settings], Kube] | None = None) -> None:
        self._settings = settings
        self._connect = connect or (lambda s: Kube.connect(s.kubeconfig))
        self._kube: Kube | None = None
        self._lock = trio.Lock()

    async def get(self) -> Kube:
        """The connected client; raises KubeError when there are no usable credentials."""
        async with self._lock:
            if self._kube is None:
                self._kube = await trio.to_thread.run_sync(self._connect, self._settings)
            return self._kube

    def close(self) -> None:
        if self._kube is not None:
            self._kube.close()
