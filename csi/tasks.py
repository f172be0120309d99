"""csi unit."""
from invoke import Collection

ns = Collection("csi")
