"""efa-device-plugin unit."""
from invoke import Collection

ns = Collection("efa")
