"""Where doeks keeps what outlives a run, outside any checkout: the build cache (Go builds, images, prices, instance
types) and the state of doeks' own running cluster (certificates, kubeconfig, etcd data, logs). One machine, one of
each; the environment can move both (DOEKS_CACHE, DOEKS_CLUSTER_DIR)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where builds are kept between runs, outside any checkout: $DOEKS_CACHE, else the user cache folder."""
    base = os.environ.get("DOEKS_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                          "doeks")
    return Path(base)


def cluster_dir() -> Path:
    """The running cluster's state (certificates, kubeconfigs, etcd data, logs): one cluster per machine."""
    base = os.environ.get("DOEKS_CLUSTER_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "doeks" / "cluster"


def kubeconfig() -> Path:
    return cluster_dir() / "admin.kubeconfig"
