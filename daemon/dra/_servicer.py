"""The gRPC face of the DRA kubelet plugin (``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``).

A thin layer over ``ClaimPreparer``: these coroutines run on the asyncio loop trio-asyncio hosts
and call the preparer (trio) through ``trio_as_aio``. Every claim of a request gets an entry in
the answer, keyed by its UID; whatever goes wrong with one claim is that claim's ``error``, never
a gRPC error (the kubelet would ignore the whole answer).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc
from trio_asyncio import trio_as_aio

from daemon._generated.dra.v1 import api_pb2 as dra
from daemon._generated.dra.v1 import api_pb2_grpc as dra_grpc

from ._claims import ClaimRef
from ._prepare import ClaimPreparer, PrepareResult

log = logging.getLogger("devplugd.dra")


def _refs(claims: Iterable[dra.Claim]) -> list[ClaimRef]:
    return [ClaimRef(namespace=claim.namespace, uid=claim.uid, name=claim.name) for claim in claims]


def _prepared(result: PrepareResult) -> dra.NodePrepareResourceResponse:
    if result.error is not None:
        return dra.NodePrepareResourceResponse(error=result.error)
    return dra.NodePrepareResourceResponse(devices=[
        dra.Device(request_names=device.request_names, pool_name=device.pool_name,
                   device_name=device.device_name, cdi_device_ids=device.cdi_ids,
                   **({"share_id": device.share_id} if device.share_id is not None else {}))
        for device in result.devices
    ])


class DraPluginServicer(dra_grpc.DRAPluginServicer):
    def __init__(self, preparer: ClaimPreparer) -> None:
        self._preparer = preparer

    async def NodePrepareResources(
        self,
        request: dra.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[dra.NodePrepareResourcesRequest, dra.NodePrepareResourcesResponse],
    ) -> dra.NodePrepareResourcesResponse:
        refs = _refs(request.claims)
        try:
            results = await trio_as_aio(self._preparer.prepare)(refs)
        except Exception as error:  # a bug: every claim gets it as its error, the call still answers
            log.exception("NodePrepareResources failed for %d claims", len(refs), extra={"EVENT": "prepare"})
            results = {}
            failure = f"internal error: {type(error).__name__}: {error}"
        else:
            failure = "internal error: no answer for this claim"
        missing = {ref.uid: PrepareResult(error=f"{ref.label}: {failure}") for ref in refs if ref.uid not in results}
        return dra.NodePrepareResourcesResponse(claims={
            ref.uid: _prepared(results.get(ref.uid) or missing[ref.uid]) for ref in refs
        })

    async def NodeUnprepareResources(
        self,
        request: dra.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[dra.NodeUnprepareResourcesRequest, dra.NodeUnprepareResourcesResponse],
    ) -> dra.NodeUnprepareResourcesResponse:
        refs = _refs(request.claims)
        try:
            errors = await trio_as_aio(self._preparer.unprepare)(refs)
        except Exception as error:
            log.exception("NodeUnprepareResources failed for %d claims", len(refs), extra={"EVENT": "unprepare"})
            errors = {ref.uid: f"{ref.label}: internal error: {type(error).__name__}: {error}" for ref in refs}
        answers = {}
        for ref in refs:
            message = errors[ref.uid] if ref.uid in errors else f"{ref.label}: internal error: no answer for this claim"
            answers[ref.uid] = dra.NodeUnprepareResourceResponse(error=message or "")
        return dra.NodeUnprepareResourcesResponse(claims=answers)


def add_to_server(servicer: DraPluginServicer, server: grpc.aio.Server) -> None:
    dra_grpc.add_DRAPluginServicer_to_server(servicer, server)
