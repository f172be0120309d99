"""TARGET=sagemaker: the reason comes from the training job's FailureReason, which carries the script's own error
in the sagemaker-training toolkit's format (aws/sagemaker-training-toolkit, src/sagemaker_training/errors.py,
_CalledProcessError.__str__: '<class>:\\nExitCode N\\nErrorMessage "<output>"\\nCommand "<cmd>"')."""
from __future__ import annotations

from doeks import sagemaker, targets
from doeks import settings as S

FAILURE = ('AlgorithmError: ExecuteUserScriptError:\nExitCode 2\nErrorMessage "usage: train.py [-h] [--data DATA]\n'
           'train.py: error: unrecognized arguments: --bogus 1"\nCommand "torchrun --nnodes 2 train.py --bogus 1"')


def described(reason: str) -> dict:
    return {"TrainingJobName": "imagenet-20261122-210000-0000", "TrainingJobStatus": "Failed", "FailureReason": reason,
            "ResourceConfig": {"InstanceCount": 2, "InstanceType": "ml.g5.12xlarge"}}


def test_failure_reason_is_classified(state_dir, monkeypatch):
    s = S.current().with_overrides(target="sagemaker")
    monkeypatch.setattr(sagemaker, "latest_job", lambda settings: "imagenet-20261122-210000-0000")
    monkeypatch.setattr(sagemaker, "describe", lambda settings, name: described(FAILURE))
    status = targets.get(s).describe()
    assert status.state == "Failed" and status.permanent
    assert status.reason == "bad arguments to the training script: unrecognized arguments: --bogus 1"
    monkeypatch.setattr(sagemaker, "describe", lambda settings, name: described("CapacityError: no ml.g5.12xlarge"))
    status = targets.get(s).describe()
    assert status.reason == "CapacityError: no ml.g5.12xlarge" and not status.permanent  # unknown: shown as it is
