"""Every wait for a pod ends when the pod cannot start (issue 55, 3a): an image the kubelet cannot pull (ErrImagePull,
ImagePullBackOff), a container config it cannot make (CreateContainerConfigError: a Secret or key missing) or a
volume it cannot mount (the FailedMount event), with the kubelet's words, instead of waiting to its limit (six hours
for a staging Job; for ever for `elasticjob.logs --follow`). The pods and events are Kubernetes' own shapes and words
(tests/test_reasons.py's), answered by the scripted kubectl; a pod still being made is waited for."""
from __future__ import annotations

import json
import time

import pytest

from doeks.errors import DoeksError

from .test_reasons import POD_CASES, _event, _pod, cluster, world  # noqa: F401 - the fixtures
from .test_targets import settings_for

PULL = POD_CASES["image"][0][0]["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
CONFIG = 'secret "doeks-train-aws" not found'
MOUNT = POD_CASES["volume"][1][0]["message"]

STUCK = {  # (pod, events, what the line must say)
    "ImagePullBackOff": (_pod("imagenet-worker-0", "Pending", {"waiting": {"reason": "ImagePullBackOff", "message": PULL}}),
                         [], f"ImagePullBackOff: {PULL}"),
    "ErrImagePull": (_pod("imagenet-worker-0", "Pending", {"waiting": {"reason": "ErrImagePull", "message": PULL[24:]}}),
                     [], "ErrImagePull: failed to pull and unpack image"),
    "CreateContainerConfigError": (
        _pod("imagenet-worker-0", "Pending", {"waiting": {"reason": "CreateContainerConfigError", "message": CONFIG}}),
        [], f"CreateContainerConfigError: {CONFIG}"),
    "FailedMount": (_pod("imagenet-worker-0", "Pending", {"waiting": {"reason": "ContainerCreating"}}),
                    [_event("imagenet-worker-0", "FailedMount", MOUNT, "kubelet", 5)], f"FailedMount: {MOUNT}"),
}


@pytest.mark.parametrize("case", list(STUCK))
def test_waiting_for_the_training_pods_ends_with_the_kubelets_words(cluster, case):  # noqa: F811
    from doeks import targets
    from doeks.targets.follow import wait_with_progress

    pod, events, said = STUCK[case]
    cluster([pod], events, state="Created")
    target = targets.get(settings_for("eks"))
    started = time.monotonic()
    with pytest.raises(DoeksError) as error:
        wait_with_progress(target, target._cursor(), quiet=True, poll=0.05, stuck_s=0)
    assert time.monotonic() - started < 30
    assert str(error.value).startswith(f"job imagenet cannot start: pod imagenet-worker-0: {case}"), str(error.value)
    assert said in str(error.value)


def test_a_pod_still_being_made_is_waited_for(cluster):  # noqa: F811
    """ContainerCreating without a FailedMount event, and a stuck pod not yet stuck for the patience: no end."""
    from doeks import targets
    from doeks.targets.follow import wait_with_progress

    cluster([_pod("imagenet-worker-0", "Pending", {"waiting": {"reason": "ContainerCreating"}})], [], state="Created")
    target = targets.get(settings_for("eks"))
    with pytest.raises(DoeksError, match="still running after"):
        wait_with_progress(target, target._cursor(), quiet=True, poll=0.05, timeout=0.5, stuck_s=0)
    cluster([STUCK["ImagePullBackOff"][0]], [], state="Created")
    with pytest.raises(DoeksError, match="still running after"):
        wait_with_progress(target, target._cursor(), quiet=True, poll=0.05, timeout=0.5, stuck_s=60)


def stage_job(world, pod: dict, events: list) -> None:  # noqa: F811
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "imagenet-stage", "namespace": "default"},
           "status": {"active": 1}}
    world["script"].write_text(json.dumps([
        {"match": ["get", "job"], "stdout": json.dumps(job)},
        {"match": ["get", "pods"], "stdout": json.dumps({"apiVersion": "v1", "kind": "List", "items": [pod]})},
        {"match": ["get", "events"], "stdout": json.dumps({"apiVersion": "v1", "kind": "List", "items": events})}]))


@pytest.mark.parametrize("case", list(STUCK))
def test_waiting_for_the_staging_job_ends_with_the_kubelets_words(world, case):  # noqa: F811
    from doeks import kube

    pod, events, said = STUCK[case]
    stage_job(world, {**pod, "metadata": {**pod["metadata"], "name": "imagenet-stage-x7k2p"}},
              [{**e, "involvedObject": {**e["involvedObject"], "name": "imagenet-stage-x7k2p"}} for e in events])
    with pytest.raises(DoeksError) as error:
        kube.wait_job("default", "imagenet-stage", "staging", timeout=30, poll=0.05, stuck_s=0)
    assert str(error.value).startswith(f"staging: Job default/imagenet-stage cannot start: pod imagenet-stage-x7k2p: "
                                       f"{case}"), str(error.value)
    assert said in str(error.value) and "kubectl describe pod imagenet-stage-x7k2p -n default" in str(error.value)
    stage_job(world, {**_pod("imagenet-stage-x7k2p", "Pending", {"waiting": {"reason": "ContainerCreating"}})}, [])
    with pytest.raises(DoeksError, match="waited 0 s for staging"):
        kube.wait_job("default", "imagenet-stage", "staging", timeout=0.3, poll=0.05, stuck_s=0)
