"""kubeflow unit."""
from invoke import Collection

ns = Collection("kubeflow")
