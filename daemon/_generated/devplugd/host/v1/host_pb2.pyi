from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Device(_message.Message):
    __slots__ = ("id", "health", "numa_nodes", "holder", "lease", "owner")
    ID_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    id: str
    health: str
    numa_nodes: _containers.RepeatedScalarFieldContainer[int]
    holder: str
    lease: str
    owner: str
    def __init__(self, id: _Optional[str] = ..., health: _Optional[str] = ..., numa_nodes: _Optional[_Iterable[int]] = ..., holder: _Optional[str] = ..., lease: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("resource", "devices", "allocation_api", "no_devices")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_API_FIELD_NUMBER: _ClassVar[int]
    NO_DEVICES_FIELD_NUMBER: _ClassVar[int]
    resource: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    allocation_api: str
    no_devices: str
    def __init__(self, resource: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., allocation_api: _Optional[str] = ..., no_devices: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("version", "pools", "lost_books")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    LOST_BOOKS_FIELD_NUMBER: _ClassVar[int]
    version: int
    pools: _containers.RepeatedCompositeFieldContainer[Pool]
    lost_books: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[Pool, _Mapping]]] = ..., lost_books: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Delta(_message.Message):
    __slots__ = ("kind", "resource", "device")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Delta.Kind]
        ADDED: _ClassVar[Delta.Kind]
        REMOVED: _ClassVar[Delta.Kind]
        CHANGED: _ClassVar[Delta.Kind]
    KIND_UNSPECIFIED: Delta.Kind
    ADDED: Delta.Kind
    REMOVED: Delta.Kind
    CHANGED: Delta.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    kind: Delta.Kind
    resource: str
    device: Device
    def __init__(self, kind: _Optional[_Union[Delta.Kind, str]] = ..., resource: _Optional[str] = ..., device: _Optional[_Union[Device, _Mapping]] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("version", "snapshot", "delta")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    version: int
    snapshot: ListResponse
    delta: Delta
    def __init__(self, version: _Optional[int] = ..., snapshot: _Optional[_Union[ListResponse, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("resource", "count", "device_ids", "owner", "numa_node")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    resource: str
    count: int
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    owner: str
    numa_node: int
    def __init__(self, resource: _Optional[str] = ..., count: _Optional[int] = ..., device_ids: _Optional[_Iterable[str]] = ..., owner: _Optional[str] = ..., numa_node: _Optional[int] = ...) -> None: ...

class DeviceSpec(_message.Message):
    __slots__ = ("container_path", "host_path", "permissions")
    CONTAINER_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    container_path: str
    host_path: str
    permissions: str
    def __init__(self, container_path: _Optional[str] = ..., host_path: _Optional[str] = ..., permissions: _Optional[str] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("container_path", "host_path", "read_only")
    CONTAINER_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_PATH_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    container_path: str
    host_path: str
    read_only: bool
    def __init__(self, container_path: _Optional[str] = ..., host_path: _Optional[str] = ..., read_only: _Optional[bool] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease", "resource", "owner", "devices", "envs", "device_specs", "mounts", "annotations", "cdi_devices", "created", "missing_devices")
    class EnvsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LEASE_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ENVS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SPECS_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    CDI_DEVICES_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MISSING_DEVICES_FIELD_NUMBER: _ClassVar[int]
    lease: str
    resource: str
    owner: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    envs: _containers.ScalarMap[str, str]
    device_specs: _containers.RepeatedCompositeFieldContainer[DeviceSpec]
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    annotations: _containers.ScalarMap[str, str]
    cdi_devices: _containers.RepeatedScalarFieldContainer[str]
    created: float
    missing_devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease: _Optional[str] = ..., resource: _Optional[str] = ..., owner: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., envs: _Optional[_Mapping[str, str]] = ..., device_specs: _Optional[_Iterable[_Union[DeviceSpec, _Mapping]]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., annotations: _Optional[_Mapping[str, str]] = ..., cdi_devices: _Optional[_Iterable[str]] = ..., created: _Optional[float] = ..., missing_devices: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: str
    def __init__(self, lease: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeasesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeasesResponse(_message.Message):
    __slots__ = ("leases", "lost")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    lost: str
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., lost: _Optional[str] = ...) -> None: ...

class ClearLostRequest(_message.Message):
    __slots__ = ("book", "operator")
    BOOK_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    book: str
    operator: str
    def __init__(self, book: _Optional[str] = ..., operator: _Optional[str] = ...) -> None: ...

class ClearLostResponse(_message.Message):
    __slots__ = ("cleared", "message")
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    cleared: bool
    message: str
    def __init__(self, cleared: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("device",)
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: str
    def __init__(self, device: _Optional[str] = ...) -> None: ...

class KnownDevice(_message.Message):
    __slots__ = ("handler", "device", "description")
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    handler: str
    device: str
    description: str
    def __init__(self, handler: _Optional[str] = ..., device: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class PoolVerdict(_message.Message):
    __slots__ = ("resource", "device_type", "outcome", "reason", "device", "health_reason", "allocation_api")
    RESOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_API_FIELD_NUMBER: _ClassVar[int]
    resource: str
    device_type: str
    outcome: str
    reason: str
    device: Device
    health_reason: str
    allocation_api: str
    def __init__(self, resource: _Optional[str] = ..., device_type: _Optional[str] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., device: _Optional[_Union[Device, _Mapping]] = ..., health_reason: _Optional[str] = ..., allocation_api: _Optional[str] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("device", "known_as", "pools", "summary")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_AS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    device: str
    known_as: _containers.RepeatedCompositeFieldContainer[KnownDevice]
    pools: _containers.RepeatedCompositeFieldContainer[PoolVerdict]
    summary: str
    def __init__(self, device: _Optional[str] = ..., known_as: _Optional[_Iterable[_Union[KnownDevice, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolVerdict, _Mapping]]] = ..., summary: _Optional[str] = ...) -> None: ...
