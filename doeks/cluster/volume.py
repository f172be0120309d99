"""doeks' own cluster as the kubernetes target sees it: whether it runs, and which folder its shared volume is on
(a PersistentVolume's hostPath cannot change, so a cluster that outlived a run with another STATE_DIR is noticed
here)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .. import kube, ui
from ..errors import DoeksError
from . import node


def stopped(settings) -> bool:
    """doeks' own cluster is the target and is not running: there is nothing on it to delete (teardown is idempotent)."""
    if not settings.own_cluster:
        return False
    return not node.pid("kube-apiserver")


def move_volume(runner, settings, manifests: Sequence[dict[str, Any]]) -> None:
    """doeks' own cluster (elsewhere the claim has no PersistentVolume of doeks': nothing to do): a PersistentVolume's
    source cannot change after it is made, so a volume left on another folder (the cluster outlived a run with another
    STATE_DIR) is made again on this one, its claim with it (a claim stays bound to its volume). The old folder keeps
    its files. A claim some pod still uses: one line naming them."""
    found = _volume_folders(settings, manifests)
    if found is None:
        return
    volume, old, new = found
    if old == new:
        return
    held = kube.pods_using_claim(settings.namespace, settings.shared_pvc)
    if held:
        raise DoeksError(f"volume {volume['metadata']['name']} is on {old}, not this STATE_DIR's {new}, and its claim "
                         f"{settings.namespace}/{settings.shared_pvc} is in use by pod {', '.join(held)}: delete "
                         f"those pods (`invoke elasticjob.delete` for the job's) and run this again, or set STATE_DIR "
                         f"back to {Path(old).parent.parent}")
    ui.say(f"volume {volume['metadata']['name']} is on {old} (another STATE_DIR): making it again on {new}; "
           f"{old} keeps its files")
    kube.delete(runner, [m for m in reversed(manifests) if m["kind"] in ("PersistentVolumeClaim", "PersistentVolume")])


def _volume_folders(settings, manifests: Sequence[dict[str, Any]]) -> tuple[dict, str | None, str] | None:
    """(the PersistentVolume of `manifests`, the folder the cluster's volume of that name is on, the folder this
    STATE_DIR's is on); None without such a volume, a running cluster, or the volume on it."""
    volume = next((m for m in manifests if m["kind"] == "PersistentVolume"), None)
    if volume is None or stopped(settings):
        return None
    current = kube.get_json(["persistentvolume", volume["metadata"]["name"]])
    if current is None:
        return None
    return volume, (current["spec"].get("hostPath") or {}).get("path"), volume["spec"]["hostPath"]["path"]


def volume_elsewhere(settings) -> str | None:
    """doeks' own cluster: the folder its shared volume is on when that is not this STATE_DIR's (the cluster was
    brought up with another STATE_DIR), else None. A job deployed then would read and write that other folder, and
    `--fresh` would clear this one."""
    found = _volume_folders(settings, kube.shared_claim(settings)) if settings.own_cluster else None
    if found is None:
        return None
    _, old, new = found
    return old if old and old != new else None
