"""doeks: distributed PyTorch training on EKS, SageMaker or this machine, driven by Invoke tasks."""

__version__ = "0.1.0"
