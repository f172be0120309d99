"""The same training defaults reach the script on every target with no flag: EKS pods and the local agents get
jobspec.train_args(), SageMaker passes its hyperparameters as `--key value` (sagemaker-training-toolkit
src/sagemaker_training/mapping.py to_cmd_args) to the same script."""
from __future__ import annotations

import pytest

from doeks import jobspec, sagemaker
from doeks import settings as S
from doeks.workload import train


@pytest.fixture
def base(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no .env here: the declared defaults
    for key in ("TARGET", "CROP_SIZE", "DATA_WORKERS", "LEARNING_RATE"):
        monkeypatch.delenv(key, raising=False)
    S.reset()
    yield S.current()
    S.reset()


def _recipe(args) -> tuple:
    return (args.crop_size, args.val_resize, args.label_smoothing, args.lr, args.warmup_epochs)


@pytest.mark.parametrize("target, crop", [("eks", 224), ("local", 32)])
def test_pods_and_local_agents_get_the_imagenet_recipe(base, target, crop):
    args = train.parse_args(jobspec.train_args(base.with_overrides(target=target)))
    assert _recipe(args) == (crop, round(crop * 256 / 224), 0.1, 0.1, min(5.0, base.epochs / 10))
    assert args.workers == train._workers("auto")  # DATA_WORKERS=auto: what the machine has


def test_sagemaker_hyperparameters_give_the_same_recipe(base):
    s = base.with_overrides(target="sagemaker")
    hyper = sagemaker.training_request(s, "arn:aws:iam::123456789012:role/r", "job-1")["HyperParameters"]
    argv = [part for key, value in hyper.items() if not key.startswith("sagemaker_") for part in (f"--{key}", value)]
    args = train.parse_args(argv)
    assert _recipe(args) == _recipe(train.parse_args(jobspec.train_args(base.with_overrides(target="eks"))))
    assert args.crop_size == 224 and hyper["workers"] == "auto"


def test_crop_size_setting_wins_everywhere(base):
    s = base.with_overrides(crop_size=160, target="sagemaker")
    hyper = sagemaker.training_request(s, "arn:aws:iam::123456789012:role/r", "job-1")["HyperParameters"]
    assert hyper["crop-size"] == "160"
    assert train.parse_args(jobspec.train_args(s.with_overrides(target="eks"))).crop_size == 160


def test_lr_schedule_scales_with_the_global_batch_and_warms_up_then_decays():
    assert train.learning_rate(0.1, 256, 5.0, 90, 5.0) == pytest.approx(0.1)  # peak after warmup
    assert train.learning_rate(0.1, 1024, 5.0, 90, 5.0) == pytest.approx(0.4)  # 4x the batch, 4x the LR
    assert train.learning_rate(0.1, 256, 2.5, 90, 5.0) == pytest.approx(0.05)  # half way through warmup
    assert train.learning_rate(0.1, 256, 47.5, 90, 5.0) == pytest.approx(0.05)  # cosine half way
    assert train.learning_rate(0.1, 256, 90.0, 90, 5.0) == pytest.approx(0.0, abs=1e-12)
