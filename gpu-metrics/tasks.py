"""gpu-metrics unit."""
from invoke import Collection

ns = Collection("gpu-metrics")
