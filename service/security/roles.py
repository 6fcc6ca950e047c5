"""The roles a token can carry and the gRPC methods each may call.

The public map is derived from the services in `proto/rlfeed.proto` (its generated
descriptor), one role per service, so a service added to the contract without a role
here fails loudly (`public_method_roles` raises) instead of being open or silently shut:

    service          methods                               roles
    RolloutIngest    SubmitRollouts, SubmitRolloutBatch    producer, admin
    TaskSampling     RegisterTasks, SampleTasks            producer, admin
    BatchServing     GetBatch, AckSteps,                   trainer, admin
                     ReportTrainerMetrics
    SidecarStatus    GetStatus                             admin

The front-ends' private peer service (`rlfeed.internal.v1.FrontEndPeer`, not part of the
contract) is open to the `peer` role only, which no token file can grant: the sidecar
makes that credential itself for its own front-ends (`peer_method_roles`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

PRODUCER = "producer"
TRAINER = "trainer"
ADMIN = "admin"
PEER = "peer"  # the front-ends among themselves; never read from a token file
FILE_ROLES = (PRODUCER, TRAINER, ADMIN)  # what a token file may grant

PUBLIC_PACKAGE = "rlfeed.v1"
PEER_SERVICE = "rlfeed.internal.v1.FrontEndPeer"
PEER_METHODS = ("GetPayload", "GetStoredResponse", "StepStored")

# rlfeed.v1 service name -> the role it exists for (admin may call everything in rlfeed.v1).
SERVICE_ROLES: Mapping[str, str] = MappingProxyType(
    {
        "RolloutIngest": PRODUCER,
        "TaskSampling": PRODUCER,
        "BatchServing": TRAINER,
        "SidecarStatus": ADMIN,
    }
)

MethodRoles = Mapping[str, frozenset[str]]  # "/package.Service/Method" -> roles allowed


def public_method_roles() -> MethodRoles:
    """Every method of the public contract -> the roles that may call it. The peer
    service is listed with the `peer` role only (a file token of any role is refused)."""
    from rlfeed.proto import rlfeed_pb2 as pb

    roles: dict[str, frozenset[str]] = {}
    for service in pb.DESCRIPTOR.services_by_name.values():
        role = SERVICE_ROLES.get(service.name)
        if role is None:
            raise RuntimeError(
                f"service {service.full_name} in rlfeed.proto has no role in "
                "rlfeed.service.security.roles.SERVICE_ROLES"
            )
        for method in service.methods:
            roles[f"/{service.full_name}/{method.name}"] = frozenset({role, ADMIN})
    for name in PEER_METHODS:
        roles[f"/{PEER_SERVICE}/{name}"] = frozenset({PEER})
    return MappingProxyType(roles)


def peer_method_roles() -> MethodRoles:
    """What the peer port serves, open to the `peer` role only: the peer service and the
    public GetBatch (a front-end forwards a rank's fetch to the one that stored the step)."""
    roles = {f"/{PEER_SERVICE}/{name}": frozenset({PEER}) for name in PEER_METHODS}
    roles[f"/{PUBLIC_PACKAGE}.BatchServing/GetBatch"] = frozenset({PEER})
    return MappingProxyType(roles)
