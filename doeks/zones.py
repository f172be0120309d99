"""The availability zones of an EKS cluster and of its GPU node group, chosen where GPU_INSTANCE_TYPE is offered (or
EKS_ZONES as given). Below doeks.eks and doeks.storage, which both need them."""
from __future__ import annotations

from .aws import client, lookup
from .errors import DoeksError


def _zone_count(region: str) -> int:
    """How many zones eksctl gives a cluster: 2 in us-east-1, else 3."""
    return 2 if region == "us-east-1" else 3


def choose_zones(settings, offered: list[str], available: list[str], reserved: str | None = None) -> tuple[list[str], str]:
    """(the cluster's zones, the GPU node group's zone) from where GPU_INSTANCE_TYPE is offered (`offered`) and the
    region's zones (`available`): the GPU zone is the reservation's, else the first offering zone; the cluster's zones
    start with it, so eksctl makes a subnet there. EKS_ZONES, when set, is used as given (first = GPU zone)."""
    if settings.eks_zones:
        return list(settings.eks_zones), settings.eks_zones[0]
    if settings.gpu_nodes_max > 0 and not (reserved or offered):
        raise DoeksError(f"GPU_INSTANCE_TYPE={settings.gpu_instance_type} is offered in no zone of {settings.aws_region}: "
                         f"choose another instance type or AWS_REGION")
    gpu = reserved or (sorted(offered)[0] if offered else sorted(available)[0])
    rest = [z for z in sorted(available) if z != gpu]
    return [gpu] + rest[: _zone_count(settings.aws_region) - 1], gpu


_ZONES: dict[tuple, tuple[list[str], str]] = {}


def zones(settings, runner=None) -> tuple[list[str], str] | None:
    """The cluster's zones and the GPU zone (see choose_zones), asked of EC2 once per process; None in a dry run
    without credentials (the plan says so)."""
    if settings.eks_zones:
        return choose_zones(settings, [], [])
    key = (settings.aws_region, settings.gpu_instance_type, settings.capacity_reservation_id, settings.aws_endpoint_url)
    if key in _ZONES:
        return _ZONES[key]
    def read():
        ec2 = client(settings, "ec2")
        offered = [o["Location"] for o in ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [settings.gpu_instance_type]}]
        )["InstanceTypeOfferings"]]
        available = [z["ZoneName"] for z in ec2.describe_availability_zones(
            Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}, {"Name": "state", "Values": ["available"]}]
        )["AvailabilityZones"]]
        reserved = None
        if settings.capacity_reservation_id:
            found = ec2.describe_capacity_reservations(CapacityReservationIds=[settings.capacity_reservation_id])["CapacityReservations"]
            reserved = found[0]["AvailabilityZone"] if found else None
        return choose_zones(settings, offered, available, reserved)

    found = lookup(runner, f"zones of {settings.aws_region} where {settings.gpu_instance_type} is offered", read)
    if found is not None:
        _ZONES[key] = found
    return found


def gpu_zone(settings, runner=None) -> str:
    chosen = zones(settings, runner)
    return chosen[1] if chosen else f"<zone of {settings.aws_region} offering {settings.gpu_instance_type}>"
