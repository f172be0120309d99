"""TARGET=eks: the kubernetes target on an EKS cluster. What AWS adds: the training image in REGISTRY or this
account's ECR (resolved before anything is applied), the GPU and EFA requests of the node type (doeks.jobspec), and
artifacts copied to S3."""
from __future__ import annotations

from .. import trainimage
from .kubernetes import KubernetesTarget


class EksTarget(KubernetesTarget):
    name = "eks"
    builds_image = False

    def checks(self):
        from ..preflight import eks_doctor_checks

        return eks_doctor_checks(self.settings)

    @property
    def on_this_machine(self) -> bool:
        return False

    def check_image(self, image: str, runner) -> None:
        trainimage.require_resolved(image)

    def refuse_image(self, image: str) -> None:
        trainimage.require_resolved(image)

    def refuse(self, plan) -> None:
        self.refuse_image(plan.image)  # the cluster is read when the job is applied (a dry run needs no cluster)

    def artifacts(self) -> dict[str, str]:
        found = super().artifacts()
        found["copy"] = "invoke csi.data.save-model copies checkpoints to S3"
        return found
