"""The moto server with the EKS operations moto 5.2 lacks (Pod Identity associations, add-ons, EKS Auth's
AssumeRoleForPodIdentity): doeks.local.motoserver (the EKS rehearsal runs it too), as a doeks Service (pid file, log,
port under STATE_DIR/services/moto)."""
from __future__ import annotations


def server(state_dir, **kwargs):
    from doeks import services

    return services.moto_eks(state_dir, **kwargs)
