"""The kube-apiserver stand-in (tests/apiserver.py), driven through the real ``kubernetes`` client.

Most tests go through the client's typed models (``ResourceV1Api``, ``CoreV1Api``, ``Watch``) to
prove the stand-in's bodies are what the client expects; raw bodies (``_preload_content=False``)
only where the test is about the wire: Status causes, watch framing, bookmarks.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import trio
import urllib3
from kubernetes.client import ApiException, CoreV1Api, ResourceV1Api, V1DeleteOptions, V1Preconditions
from kubernetes.watch import Watch

from tests.apiserver import ApiServer

TOKEN = "standin-token"
DRIVER = "devplugd.example.com"


def slice_body(node: str | None = "node-a", driver: str = DRIVER, pool: str | None = None, devices: int = 1,
               generation: int = 0, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"generateName": f"{node}-{driver}-"},
        "spec": {"driver": driver, "pool": {"name": pool or f"{node}/nics", "generation": generation,
                                            "resourceSliceCount": 1},
                 "devices": [{"name": f"dev-{i}", "attributes": {"index": {"int": i}}} for i in range(devices)]}}
    if node is not None:
        body["spec"]["nodeName"] = node
    body["spec"].update(spec)
    return body


def error_of(raised: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    status: dict[str, Any] = json.loads(raised.value.body)
    return status


def client_for(api: ApiServer, kubeconfig: Path) -> kubernetes.client.ApiClient:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(api.kubeconfig(kubeconfig)),
                                       client_configuration=configuration)
    return kubernetes.client.ApiClient(configuration)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(token=TOKEN) as server:
        yield server
    assert server.internal_errors == []


@pytest.fixture
def client(api: ApiServer, tmp_path: Path) -> Iterator[kubernetes.client.ApiClient]:
    with client_for(api, tmp_path / "kubeconfig") as api_client:
        yield api_client


@pytest.fixture
def resource(client: kubernetes.client.ApiClient) -> ResourceV1Api:
    return ResourceV1Api(client)


class Watching:
    """``Watch().stream`` in a thread, collecting ``(type, name, resourceVersion)`` until ``count``."""

    def __init__(self, api: ApiServer, resource: ResourceV1Api, count: int, **kwargs: Any) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.error: BaseException | None = None
        self.watch = Watch()
        kwargs.setdefault("timeout_seconds", 20)
        if kwargs["timeout_seconds"] is None:
            del kwargs["timeout_seconds"]  # the key's presence alone stops Watch from resuming
        self._thread = threading.Thread(target=self._run, args=(resource, count, kwargs), daemon=True)
        opened = api.watch_count
        self._thread.start()
        api.wait_until(lambda: api.watch_count > opened, what="the watch to open")

    def _run(self, resource: ResourceV1Api, count: int, kwargs: dict[str, Any]) -> None:
        try:
            for event in self.watch.stream(resource.list_resource_slice, **kwargs):
                meta = event["object"].metadata
                self.events.append((event["type"], meta.name, meta.resource_version))
                if len(self.events) == count:
                    self.watch.stop()
        except BaseException as error:  # noqa: BLE001 -- handed to the test
            self.error = error

    def join(self) -> list[tuple[str, str, str]]:
        self._thread.join(20)
        assert not self._thread.is_alive(), f"watch still running with {self.events}"
        return self.events


# -- create, get, list -----------------------------------------------------------------------
def test_create_with_generate_name_gets_server_set_name_uid_version_and_generation(
        api: ApiServer, resource: ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body(devices=2))

    assert created.metadata.name.startswith(f"node-a-{DRIVER}-")
    assert len(created.metadata.name) == len(f"node-a-{DRIVER}-") + 5
    assert created.metadata.uid and created.metadata.creation_timestamp is not None
    assert created.metadata.generation == 1
    assert int(created.metadata.resource_version) == api.resource_version
    assert [device.name for device in created.spec.devices] == ["dev-0", "dev-1"]
    assert created.spec.devices[1].attributes["index"].int == 1
    fetched = resource.read_resource_slice(created.metadata.name)
    assert fetched.metadata.uid == created.metadata.uid
    assert api.slices(driver=DRIVER, node="node-a")[0]["metadata"]["name"] == created.metadata.name
    assert api.requests[0][:2] == ("POST", "/apis/resource.k8s.io/v1/resourceslices")
    assert api.requests[0].status == 201


def test_create_with_a_taken_name_is_409_already_exists(resource: ResourceV1Api) -> None:
    body = slice_body()
    body["metadata"] = {"name": "fixed"}
    resource.create_resource_slice(body)

    with pytest.raises(ApiException) as raised:
        resource.create_resource_slice(body)

    assert raised.value.status == 409
    assert error_of(raised)["reason"] == "AlreadyExists"
    assert error_of(raised)["message"] == 'resourceslices.resource.k8s.io "fixed" already exists'


def test_get_of_a_missing_slice_is_404_not_found(resource: ResourceV1Api) -> None:
    with pytest.raises(ApiException) as raised:
        resource.read_resource_slice("nope")

    assert raised.value.status == 404
    assert error_of(raised)["reason"] == "NotFound"
    assert error_of(raised)["details"] == {"name": "nope", "group": "resource.k8s.io", "kind": "resourceslices"}


def test_list_field_selector_filters_by_driver_and_node(api: ApiServer, resource: ResourceV1Api) -> None:
    mine = resource.create_resource_slice(slice_body("node-a")).metadata.name
    resource.create_resource_slice(slice_body("node-b"))
    resource.create_resource_slice(slice_body("node-a", driver="other.example.com"))

    listed = resource.list_resource_slice(field_selector=f"spec.driver={DRIVER},spec.nodeName=node-a")

    assert [item.metadata.name for item in listed.items] == [mine]
    assert int(listed.metadata.resource_version) == api.resource_version
    others = resource.list_resource_slice(field_selector="spec.nodeName==node-a,spec.driver!=" + DRIVER)
    assert [item.spec.driver for item in others.items] == ["other.example.com"]
    assert len(resource.list_resource_slice().items) == 3


def test_unsupported_field_selector_is_400(resource: ResourceV1Api) -> None:
    with pytest.raises(ApiException) as raised:
        resource.list_resource_slice(field_selector="spec.pool.name=x")

    assert raised.value.status == 400
    assert error_of(raised)["message"] == "field label not supported: spec.pool.name"


# -- watch -----------------------------------------------------------------------------------
def test_watch_from_a_resource_version_sees_only_later_events_in_order(
        api: ApiServer, resource: ResourceV1Api) -> None:
    before = resource.create_resource_slice(slice_body("node-a")).metadata.name
    since = resource.list_resource_slice().metadata.resource_version
    later = resource.create_resource_slice(slice_body("node-a", devices=1))
    later.spec.devices.append(kubernetes.client.V1Device(name="dev-9"))
    resource.replace_resource_slice(later.metadata.name, later)
    resource.delete_resource_slice(before)

    watching = Watching(api, resource, 3, resource_version=since)
    events = watching.join()

    assert [(kind, name) for kind, name, _ in events] == [
        ("ADDED", later.metadata.name), ("MODIFIED", later.metadata.name), ("DELETED", before)]
    versions = [int(rv) for _, _, rv in events]
    assert versions == sorted(versions) and versions[0] > int(since)
    assert versions[-1] == api.resource_version  # a DELETED carries the deletion's resourceVersion


def test_live_watch_gets_only_the_slices_its_field_selector_selects(api: ApiServer, resource: ResourceV1Api) -> None:
    since = resource.list_resource_slice().metadata.resource_version
    watching = Watching(api, resource, 2, resource_version=since, field_selector="spec.nodeName=node-b")

    resource.create_resource_slice(slice_body("node-a"))
    first = resource.create_resource_slice(slice_body("node-b")).metadata.name
    resource.create_resource_slice(slice_body("node-a"))
    second = resource.create_resource_slice(slice_body("node-b")).metadata.name

    assert [(kind, name) for kind, name, _ in watching.join()] == [("ADDED", first), ("ADDED", second)]


def test_watch_without_resource_version_starts_with_the_current_state(
        api: ApiServer, resource: ResourceV1Api) -> None:
    existing = sorted(resource.create_resource_slice(slice_body()).metadata.name for _ in range(2))

    watching = Watching(api, resource, 3)
    added = resource.create_resource_slice(slice_body()).metadata.name

    assert [(kind, name) for kind, name, _ in watching.join()] == [
        ("ADDED", existing[0]), ("ADDED", existing[1]), ("ADDED", added)]


def test_watch_client_resumes_from_the_last_resource_version_when_the_server_ends_the_stream(
        api: ApiServer, resource: ResourceV1Api) -> None:
    since = resource.list_resource_slice().metadata.resource_version
    watching = Watching(api, resource, 2, resource_version=since, timeout_seconds=None)
    first = resource.create_resource_slice(slice_body())
    api.wait_until(lambda: watching.events, what="the first event")

    api.close_watches()
    api.wait_until(lambda: sum(r.query.get("watch") == "True" for r in api.requests) == 2, what="a second watch")
    second = resource.create_resource_slice(slice_body())

    assert [name for _, name, _ in watching.join()] == [first.metadata.name, second.metadata.name]
    watches = [r.query for r in api.requests if r.query.get("watch") == "True"]
    assert [w["resourceVersion"] for w in watches] == [since, first.metadata.resource_version]


def test_a_watch_the_client_closes_ends_on_the_server_at_once(api: ApiServer, resource: ResourceV1Api) -> None:
    watching = Watching(api, resource, 1, timeout_seconds=600)
    resource.create_resource_slice(slice_body())

    assert len(watching.join()) == 1
    api.wait_until(lambda: api.watch_count == 0, what="the server to notice the hang-up")


def test_watch_from_a_compacted_resource_version_is_410_expired(api: ApiServer, resource: ResourceV1Api) -> None:
    old = resource.list_resource_slice().metadata.resource_version
    resource.create_resource_slice(slice_body())
    api.compact()

    raw = resource.list_resource_slice(watch=True, resource_version=old, timeout_seconds=5, _preload_content=False)
    lines = raw.data.decode().splitlines()

    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["type"] == "ERROR"
    assert event["object"]["reason"] == "Expired" and event["object"]["code"] == 410
    with pytest.raises(ApiException) as raised:
        list(Watch().stream(resource.list_resource_slice, resource_version=old, timeout_seconds=5))
    assert raised.value.status == 410
    current = resource.list_resource_slice().metadata.resource_version
    watching = Watching(api, resource, 1, resource_version=current)  # from now on: only what comes next
    created = resource.create_resource_slice(slice_body()).metadata.name
    assert [(kind, name) for kind, name, _ in watching.join()] == [("ADDED", created)]


def test_bookmarks_go_only_to_watches_that_allow_them(api: ApiServer, resource: ResourceV1Api) -> None:
    since = resource.list_resource_slice().metadata.resource_version
    with_bookmarks = resource.list_resource_slice(watch=True, resource_version=since, allow_watch_bookmarks=True,
                                                  timeout_seconds=2, _preload_content=False)
    without = resource.list_resource_slice(watch=True, resource_version=since, timeout_seconds=2,
                                           _preload_content=False)
    api.wait_until(lambda: api.watch_count == 2)
    resource.create_resource_slice(slice_body())
    api.bookmark()
    api.close_watches()

    allowed = [json.loads(line) for line in with_bookmarks.data.decode().splitlines()]
    plain = [json.loads(line) for line in without.data.decode().splitlines()]

    assert [e["type"] for e in allowed] == ["ADDED", "BOOKMARK"]
    assert allowed[1]["object"]["metadata"]["resourceVersion"] == str(api.resource_version)
    assert [e["type"] for e in plain] == ["ADDED"]
    assert with_bookmarks.headers["Transfer-Encoding"] == "chunked"


# -- update ---------------------------------------------------------------------------------
def test_put_with_a_stale_resource_version_is_409_conflict(resource: ResourceV1Api) -> None:
    stale = resource.create_resource_slice(slice_body())
    fresh = resource.read_resource_slice(stale.metadata.name)
    fresh.spec.pool.generation = 1
    resource.replace_resource_slice(fresh.metadata.name, fresh)

    stale.spec.pool.generation = 2
    with pytest.raises(ApiException) as raised:
        resource.replace_resource_slice(stale.metadata.name, stale)

    assert raised.value.status == 409
    assert error_of(raised)["reason"] == "Conflict"
    assert "the object has been modified" in error_of(raised)["message"]
    assert resource.read_resource_slice(stale.metadata.name).spec.pool.generation == 1


def test_put_bumps_metadata_generation_only_when_the_spec_changes(resource: ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    created.metadata.labels = {"seen": "yes"}
    relabelled = resource.replace_resource_slice(created.metadata.name, created)
    unchanged = resource.replace_resource_slice(created.metadata.name, relabelled)
    relabelled.spec.pool.generation = 5
    respecced = resource.replace_resource_slice(created.metadata.name, relabelled)

    assert relabelled.metadata.generation == 1
    assert unchanged.metadata.resource_version == relabelled.metadata.resource_version  # a no-op writes nothing
    assert respecced.metadata.generation == 2
    assert int(respecced.metadata.resource_version) > int(relabelled.metadata.resource_version)
    assert respecced.metadata.uid == created.metadata.uid


def test_put_of_immutable_fields_is_422_with_one_cause_each(resource: ResourceV1Api) -> None:
    body = resource.api_client.sanitize_for_serialization(resource.create_resource_slice(slice_body()))
    body["spec"].update(driver="other.example.com", nodeName="node-z")
    body["spec"]["pool"]["name"] = "node-z/nics"

    with pytest.raises(ApiException) as raised:
        resource.replace_resource_slice(body["metadata"]["name"], body)

    status = error_of(raised)
    assert raised.value.status == 422 and status["reason"] == "Invalid"
    assert status["details"]["causes"] == [
        {"reason": "FieldValueInvalid", "message": 'Invalid value: "node-z/nics": field is immutable',
         "field": "spec.pool.name"},
        {"reason": "FieldValueInvalid", "message": 'Invalid value: "other.example.com": field is immutable',
         "field": "spec.driver"},
        {"reason": "FieldValueInvalid", "message": 'Invalid value: "node-z": field is immutable',
         "field": "spec.nodeName"}]
    assert status["message"].startswith(f'ResourceSlice.resource.k8s.io "{body["metadata"]["name"]}" is invalid: '
                                        '[spec.pool.name: Invalid value: "node-z/nics": field is immutable, ')


def test_put_without_resource_version_is_unconditional_as_upstream(resource: ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    body = resource.api_client.sanitize_for_serialization(created)
    del body["metadata"]["resourceVersion"]
    body["spec"]["pool"]["generation"] = 3

    updated = resource.replace_resource_slice(created.metadata.name, body)

    assert updated.spec.pool.generation == 3 and updated.metadata.generation == 2


# -- validation ------------------------------------------------------------------------------
def test_more_than_128_devices_is_422_too_many(resource: ResourceV1Api) -> None:
    with pytest.raises(ApiException) as raised:
        resource.create_resource_slice(slice_body(devices=129))

    status = error_of(raised)
    assert raised.value.status == 422
    assert status["details"]["causes"] == [{"reason": "FieldValueTooMany", "field": "spec.devices",
                                            "message": "Too many: 129: must have at most 128 items"}]
    resource.create_resource_slice(slice_body(devices=128))


def test_bad_attributes_are_422_with_upstreams_messages(resource: ResourceV1Api) -> None:
    body = slice_body()
    body["spec"]["devices"] = [
        {"name": "dev-0", "attributes": {"both": {"int": 1, "string": "x"}, "none": {}}},
        {"name": "dev-1", "attributes": {"driverVersion": {"version": "1.2"}, "long": {"string": "x" * 65}}},
        {"name": "Dev_2", "attributes": {"9lives": {"bool": True}, "a/b/c": {"int": 1}}},
        {"name": "dev-0"}]

    with pytest.raises(ApiException) as raised:
        resource.create_resource_slice(body)

    causes = {(c["field"], c["message"]) for c in error_of(raised)["details"]["causes"]}
    assert ("spec.devices[0].attributes[both]", 'Invalid value: {"int":1,"string":"x"}: exactly one value must be '
            "specified") in causes
    assert ("spec.devices[0].attributes[none]", 'Invalid value: "": exactly one value must be specified') in causes
    assert ("spec.devices[1].attributes[driverVersion].version",
            'Invalid value: "1.2": must be a string compatible with semver.org spec 2.0.0') in causes
    assert ("spec.devices[1].attributes[long].string", "Too long: may not be more than 64 bytes") in causes
    assert ("spec.devices[2].name", 'Invalid value: "Dev_2": a lowercase RFC 1123 label must consist of lower case '
            "alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. "
            "'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')") in causes
    assert any(f == "spec.devices[2].attributes" and m.startswith('Invalid value: "9lives": a valid C identifier')
               for f, m in causes)
    assert ("spec.devices[2].attributes", 'Invalid value: "a/b/c": must not contain more than one slash') in causes
    assert ("spec.devices[3]", 'Duplicate value: "dev-0"') in causes
    assert len(causes) == 8


def test_more_than_32_attributes_and_capacities_is_422(resource: ResourceV1Api) -> None:
    body = slice_body()
    body["spec"]["devices"][0]["attributes"] = {f"a{i}": {"int": i} for i in range(30)}
    body["spec"]["devices"][0]["capacity"] = {f"c{i}": {"value": "1"} for i in range(3)}

    with pytest.raises(ApiException) as raised:
        resource.create_resource_slice(body)

    assert error_of(raised)["details"]["causes"] == [{
        "reason": "FieldValueInvalid", "field": "spec.devices[0]",
        "message": "Invalid value: 33: the total number of attributes and capacities must not exceed 32"}]


@pytest.mark.parametrize(("spec", "field", "message"), [
    ({"nodeName": ""}, "spec.nodeName", 'Invalid value: "": must be either unset or set to a non-empty string'),
    ({"nodeName": None}, "spec", "Required value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                                 "`perDeviceNodeSelection` is required"),
    ({"allNodes": True}, "spec", 'Invalid value: "{`nodeName`, `allNodes`}": exactly one of `nodeName`, '
                                 "`nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required, but multiple "
                                 "fields are set"),
    ({"pool": {"name": "node-a/nics", "generation": -1, "resourceSliceCount": 1}}, "spec.pool.generation",
     "Invalid value: -1: must be greater than or equal to zero"),
    ({"pool": {"name": "node-a/nics", "generation": 0, "resourceSliceCount": 0}}, "spec.pool.resourceSliceCount",
     "Invalid value: 0: must be greater than zero"),
    ({"pool": {"name": "node-a//x", "generation": 0, "resourceSliceCount": 1}}, "spec.pool.name",
     'Invalid value: "": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '
     "'-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
     "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"),
    ({"driver": "d" * 64 + ".example.com"}, "spec.driver", "Too long: may not be more than 63 bytes"),
])
def test_spec_rules_are_422_with_upstreams_message(resource: ResourceV1Api, spec: dict[str, Any], field: str,
                                                    message: str) -> None:
    body = slice_body()
    body["spec"].update(spec)

    with pytest.raises(ApiException) as raised:
        resource.create_resource_slice(body)

    assert raised.value.status == 422
    cause = error_of(raised)["details"]["causes"][0]
    assert (cause["field"], cause["message"]) == (field, message)


def test_owner_references_must_be_complete(api: ApiServer, resource: ResourceV1Api) -> None:
    uid = api.add_node("node-a")
    body = slice_body()
    body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": uid,
                                            "controller": True}]
    resource.create_resource_slice(body)
    body["metadata"]["ownerReferences"][0]["uid"] = ""

    with pytest.raises(ApiException) as raised:
        resource.create_resource_slice(body)

    assert error_of(raised)["details"]["causes"] == [{"reason": "FieldValueInvalid", "field":
                                                      "metadata.ownerReferences.uid",
                                                      "message": 'Invalid value: "": uid must not be empty'}]


def tainted(count: int) -> dict[str, Any]:
    """A slice of ``count`` devices, the first with a taint."""
    body = slice_body(devices=count)
    body["spec"]["devices"][0]["taints"] = [{"key": "devplugd.io/carrier-lost", "effect": "NoSchedule"}]
    return body


def test_taints_are_dropped_unless_their_gate_is_on_and_cap_a_slice_at_64_devices(
        resource: ResourceV1Api, tmp_path: Path) -> None:
    dropped = resource.create_resource_slice(tainted(65))  # 1.35's default: the write succeeds without them
    assert dropped.spec.devices[0].taints is None and len(dropped.spec.devices) == 65

    with ApiServer(feature_gates={"DRADeviceTaints"}) as gated, client_for(gated, tmp_path / "kc") as c:
        kept = ResourceV1Api(c).create_resource_slice(tainted(64))
        with pytest.raises(ApiException) as raised:
            ResourceV1Api(c).create_resource_slice(tainted(65))
        bad_effect = tainted(1)
        bad_effect["spec"]["devices"][0]["taints"][0]["effect"] = "Evict"
        with pytest.raises(ApiException) as unsupported:
            ResourceV1Api(c).create_resource_slice(bad_effect)
    assert [(t.key, t.effect) for t in kept.spec.devices[0].taints] == [("devplugd.io/carrier-lost", "NoSchedule")]
    assert error_of(raised)["details"]["causes"] == [{"reason": "FieldValueTooMany", "field": "spec.devices",
                                                      "message": "Too many: 65: must have at most 64 items"}]
    assert error_of(unsupported)["details"]["causes"] == [{
        "reason": "FieldValueNotSupported", "field": "spec.devices[0].taints[0].effect",
        "message": 'Unsupported value: "Evict": supported values: "NoExecute", "NoSchedule", "None"'}]


def test_shared_device_fields_are_dropped_unless_their_gate_is_on(resource: ResourceV1Api, tmp_path: Path) -> None:
    body = slice_body()
    body["spec"]["devices"][0].update(allowMultipleAllocations=True, capacity={"shares": {
        "value": "4", "requestPolicy": {"default": "1"}}})
    dropped = json.loads(resource.create_resource_slice(body, _preload_content=False).data)["spec"]["devices"][0]
    assert "allowMultipleAllocations" not in dropped and dropped["capacity"] == {"shares": {"value": "4"}}

    with ApiServer(feature_gates={"DRAConsumableCapacity"}) as gated, client_for(gated, tmp_path / "kc") as c:
        kept = json.loads(ResourceV1Api(c).create_resource_slice(body, _preload_content=False).data)
        del body["spec"]["devices"][0]["allowMultipleAllocations"]
        with pytest.raises(ApiException) as raised:
            ResourceV1Api(c).create_resource_slice(body)
    assert kept["spec"]["devices"][0]["allowMultipleAllocations"] is True
    assert kept["spec"]["devices"][0]["capacity"]["shares"]["requestPolicy"] == {"default": "1"}
    assert error_of(raised)["details"]["causes"] == [{
        "reason": "FieldValueForbidden", "field": "spec.devices[0].capacity[shares].requestPolicy",
        "message": "Forbidden: allowMultipleAllocations must be true"}]


def test_a_request_policy_range_must_fit_the_capacity(tmp_path: Path) -> None:
    def shared(value: str, valid_range: dict[str, str], default: str = "1") -> dict[str, Any]:
        body = slice_body()
        body["spec"]["devices"][0].update(allowMultipleAllocations=True, capacity={"shares": {
            "value": value, "requestPolicy": {"default": default, "validRange": valid_range}}})
        return body

    with ApiServer(feature_gates={"DRAConsumableCapacity"}) as gated, client_for(gated, tmp_path / "kc") as c:
        ResourceV1Api(c).create_resource_slice(shared("1", {"min": "1"}))  # one share left, no step
        with pytest.raises(ApiException) as one_step:
            ResourceV1Api(c).create_resource_slice(shared("1", {"min": "1", "step": "1"}))
        with pytest.raises(ApiException) as below:
            ResourceV1Api(c).create_resource_slice(shared("4", {"min": "2", "step": "2"}, default="3"))
    path = "spec.devices[0].capacity[shares].requestPolicy.validRange"
    assert error_of(one_step)["details"]["causes"] == [{
        "reason": "FieldValueInvalid", "field": f"{path}.step",
        "message": 'Invalid value: "1": one step 2 is larger than capacity value: 1'}]
    assert [c["message"] for c in error_of(below)["details"]["causes"]] == [
        'Invalid value: "3": value is not a multiple of a given step (2) from (2)']


def test_unknown_fields_are_dropped_with_a_warning(api: ApiServer, resource: ResourceV1Api) -> None:
    body = slice_body()
    body["spec"]["devices"][0]["colour"] = "blue"

    raw = resource.create_resource_slice(body, _preload_content=False)

    assert raw.headers["Warning"] == '299 - "unknown field \\"spec.devices[0].colour\\""'
    assert "colour" not in json.loads(raw.data)["spec"]["devices"][0]
    assert len(api.slices()) == 1


# -- delete ----------------------------------------------------------------------------------
def test_delete_with_a_mismatched_precondition_is_409_and_keeps_the_slice(resource: ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    name = created.metadata.name

    with pytest.raises(ApiException) as by_uid:
        resource.delete_resource_slice(name, body=V1DeleteOptions(preconditions=V1Preconditions(uid="other")))
    with pytest.raises(ApiException) as by_version:
        resource.delete_resource_slice(name, body=V1DeleteOptions(preconditions=V1Preconditions(
            uid=created.metadata.uid, resource_version="1" + created.metadata.resource_version)))

    assert by_uid.value.status == by_version.value.status == 409
    assert error_of(by_uid)["message"] == (f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}": '
                                           f"Precondition failed: UID in precondition: other, UID in object meta: "
                                           f"{created.metadata.uid}")
    assert "ResourceVersion in precondition" in error_of(by_version)["message"]
    deleted = resource.delete_resource_slice(name, body=V1DeleteOptions(preconditions=V1Preconditions(
        uid=created.metadata.uid, resource_version=created.metadata.resource_version)))
    assert deleted.metadata.name == name
    with pytest.raises(ApiException) as gone:
        resource.delete_resource_slice(name)
    assert gone.value.status == 404


def test_a_wipe_by_node_emits_deleted_events_for_that_node_only(api: ApiServer, resource: ResourceV1Api) -> None:
    doomed = sorted(resource.create_resource_slice(slice_body("node-a")).metadata.name for _ in range(2))
    kept = resource.create_resource_slice(slice_body("node-b")).metadata.name
    since = resource.list_resource_slice().metadata.resource_version
    watching = Watching(api, resource, 2, resource_version=since)

    assert api.wipe("node-a") == 2

    events = watching.join()
    assert [(kind, name) for kind, name, _ in events] == [("DELETED", doomed[0]), ("DELETED", doomed[1])]
    assert [s["metadata"]["name"] for s in api.slices()] == [kept]


def test_wipe_deletes_one_drivers_slices_of_a_node(api: ApiServer, resource: ResourceV1Api) -> None:
    resource.create_resource_slice(slice_body("node-a"))
    other = resource.create_resource_slice(slice_body("node-a", driver="other.example.com")).metadata.name

    assert api.wipe("node-a", DRIVER) == 1
    assert [s["metadata"]["name"] for s in api.slices()] == [other]
    assert api.wipe("node-a") == 1 and api.slices() == []


# -- nodes, claims ---------------------------------------------------------------------------
def test_node_get_gives_its_uid_and_404_otherwise(api: ApiServer, client: kubernetes.client.ApiClient) -> None:
    uid = api.add_node("node-a")
    core = CoreV1Api(client)

    assert core.read_node("node-a").metadata.uid == uid
    with pytest.raises(ApiException) as raised:
        core.read_node("node-b")
    assert raised.value.status == 404
    assert error_of(raised)["message"] == 'nodes "node-b" not found'


def test_claim_get_gives_the_allocation_and_404_otherwise(api: ApiServer, resource: ResourceV1Api) -> None:
    uid = api.put_claim("ns", "claim-1", results=[
        {"request": "nic", "driver": DRIVER, "pool": "node-a/nics", "device": "dev-0"},
        {"request": "nic/fast", "driver": DRIVER, "pool": "node-a/nics", "device": "dev-1", "adminAccess": True}],
        config=[{"requests": ["nic"], "opaque": {"driver": DRIVER, "parameters": {"mtu": 9000}}}])

    claim = resource.read_namespaced_resource_claim("claim-1", "ns")

    assert claim.metadata.uid == uid
    results = claim.status.allocation.devices.results
    assert [(r.request, r.pool, r.device, r.admin_access) for r in results] == [
        ("nic", "node-a/nics", "dev-0", None), ("nic/fast", "node-a/nics", "dev-1", True)]
    assert [(r.name, r.exactly.count) for r in claim.spec.devices.requests] == [("nic", 2)]  # a subrequest's main
    assert claim.status.allocation.devices.config[0].opaque.parameters == {"mtu": 9000}
    assert claim.status.allocation.devices.config[0].source == "FromClaim"
    api.delete_claim("ns", "claim-1")
    with pytest.raises(ApiException) as raised:
        resource.read_namespaced_resource_claim("claim-1", "ns")
    assert raised.value.status == 404
    assert error_of(raised)["reason"] == "NotFound"


def test_claim_status_put_takes_only_devices_of_the_allocation(api: ApiServer, resource: ResourceV1Api) -> None:
    api.put_claim("ns", "claim-1", results=[{"request": "nic", "driver": DRIVER, "pool": "p", "device": "dev-0"}])
    claim = resource.read_namespaced_resource_claim("claim-1", "ns")
    body = resource.api_client.sanitize_for_serialization(claim)
    body["status"]["devices"] = [{"driver": DRIVER, "pool": "p", "device": "dev-0", "data": {"ready": True}}]

    updated = resource.replace_namespaced_resource_claim_status("claim-1", "ns", body)
    with pytest.raises(ApiException) as stale:
        resource.replace_namespaced_resource_claim_status("claim-1", "ns", body)
    body["metadata"]["resourceVersion"] = updated.metadata.resource_version
    body["status"]["devices"][0]["device"] = "dev-7"
    with pytest.raises(ApiException) as foreign:
        resource.replace_namespaced_resource_claim_status("claim-1", "ns", body)

    assert updated.status.devices[0].data == {"ready": True}
    assert stale.value.status == 409
    assert foreign.value.status == 422
    assert error_of(foreign)["details"]["causes"][0]["message"] == (
        f'Invalid value: "{DRIVER}/p/dev-7": must be an allocated device in the claim')


def test_unallocated_claim_has_no_allocation(api: ApiServer, resource: ResourceV1Api) -> None:
    api.put_claim("ns", "pending")

    assert resource.read_namespaced_resource_claim("pending", "ns").status.allocation is None


# -- authentication, faults, the server going away -------------------------------------------
def test_a_wrong_or_missing_token_is_401(api: ApiServer) -> None:
    wrong = kubernetes.client.Configuration(host=api.url, api_key={"authorization": "wrong"},
                                            api_key_prefix={"authorization": "Bearer"})
    missing = kubernetes.client.Configuration(host=api.url)
    statuses = []
    for configuration in (wrong, missing):
        with kubernetes.client.ApiClient(configuration) as api_client, pytest.raises(ApiException) as raised:
            ResourceV1Api(api_client).list_resource_slice()
        statuses.append((raised.value.status, error_of(raised)["reason"]))

    assert statuses == [(401, "Unauthorized"), (401, "Unauthorized")]
    assert [r.status for r in api.requests] == [401, 401]


def test_fail_next_answers_a_status_then_serves_normally(api: ApiServer, resource: ResourceV1Api) -> None:
    api.fail_next("create", "/resourceslices$", 503, count=2)

    for _ in range(2):
        with pytest.raises(ApiException) as raised:
            resource.create_resource_slice(slice_body())
        assert raised.value.status == 503
        assert error_of(raised)["reason"] == "ServiceUnavailable"
    resource.create_resource_slice(slice_body())

    assert [r.status for r in api.requests] == [503, 503, 201]


def test_fail_next_with_a_delay_models_a_create_that_times_out_but_happens(
        api: ApiServer, resource: ResourceV1Api) -> None:
    api.fail_next("create", "resourceslices", None, delay=0.5)

    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        resource.create_resource_slice(slice_body(), _request_timeout=(1, 0.1))

    api.wait_until(lambda: api.requests, what="the delayed request to be served")
    assert api.requests[0].status == 201 and len(api.slices()) == 1


def test_fail_next_conflict_on_an_update_names_the_slice(api: ApiServer, resource: ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body())
    api.fail_next("PUT", "/resourceslices/", 409)

    with pytest.raises(ApiException) as raised:
        resource.replace_resource_slice(created.metadata.name, created)

    assert error_of(raised)["reason"] == "Conflict"
    assert error_of(raised)["message"] == (f"Operation cannot be fulfilled on resourceslices.resource.k8s.io "
                                           f'"{created.metadata.name}": the object has been modified; please apply '
                                           "your changes to the latest version and try again")
    resource.replace_resource_slice(created.metadata.name, created)


def test_down_refuses_connections_and_up_serves_the_same_state_on_the_same_port(
        api: ApiServer, resource: ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body()).metadata.name
    port = api.port

    api.down()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        resource.list_resource_slice()
    api.up()

    assert api.port == port
    assert [item.metadata.name for item in resource.list_resource_slice().items] == [created]


def test_down_breaks_an_open_watch(api: ApiServer, resource: ResourceV1Api) -> None:
    watching = Watching(api, resource, 1, timeout_seconds=None)

    api.down()

    assert watching.join() == []
    assert isinstance(watching.error, urllib3.exceptions.HTTPError), watching.error


def test_wait_until_times_out_with_an_assertion_naming_the_slices_and_requests(
        api: ApiServer, resource: ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body()).metadata.name

    with pytest.raises(AssertionError, match="a second slice") as raised:
        api.wait_until(lambda: len(api.slices()) == 2, timeout=0.2, what="a second slice")

    assert f"slices={{'{created}': " in str(raised.value) and "'POST', path=" in str(raised.value)


async def test_wait_until_async_waits_without_blocking_trio(api: ApiServer, resource: ResourceV1Api) -> None:
    async def publish() -> None:
        await trio.sleep(0.05)
        await trio.to_thread.run_sync(resource.create_resource_slice, slice_body())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(publish)
        slices = await api.wait_until_async(lambda: api.slices(driver=DRIVER), timeout=5)

    assert len(slices) == 1


def test_4096_devices_in_32_slices_publish_and_republish(api: ApiServer, resource: ResourceV1Api) -> None:
    def device(index: int) -> dict[str, Any]:
        return {"name": f"dev-{index}", "attributes": {
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{index // 256:02x}:{index % 256 // 8:02x}.{index % 8}"},
            "vendor": {"string": "0x8086"}, "vfID": {"int": index}, "driverVersion": {"version": "1.2.3"}}}

    created = []
    for index in range(32):
        body = slice_body(pool="node-a/nics")
        body["spec"]["pool"]["resourceSliceCount"] = 32
        body["spec"]["devices"] = [device(index * 128 + i) for i in range(128)]
        created.append(json.loads(resource.create_resource_slice(body, _preload_content=False).data))
    for stored in created:
        stored["spec"]["pool"]["generation"] = 1
        resource.replace_resource_slice(stored["metadata"]["name"], stored, _preload_content=False)

    assert sum(len(s["spec"]["devices"]) for s in api.slices(driver=DRIVER)) == 4096
    assert {s["spec"]["pool"]["generation"] for s in api.slices()} == {1}
