"""Every private torch name doeks relies on, in one list, checked against the running torch before doeks uses it.

doeks patches torch's elastic agent and etcd rendezvous (doeks.pod.torchrun, doeks.pod.watchdog, doeks.local.agent) and reads
checkpoints through DCP's reader internals (doeks/workload/checkpoints.py). A name torch moves or renames would
otherwise break every pod of a job with a traceback deep inside a patch; `check()` says it in one line, naming the
torch version and the names, before anything is patched. TESTED is the torch every image and the test suite run
(tests/test_torchcompat.py holds the images to it).

Standard library and torch only: it is staged into the training image beside doeks.pod.torchrun.
"""
from __future__ import annotations

import importlib
import inspect

# The torch version(s) the suite runs and every image carries (pyproject's pin, doeks.trainimage.TORCH_VERSION).
TESTED = ("2.13.0",)

# (user, module, attribute path): a class attribute or method doeks reads or replaces, or a module's name.
NAMES: tuple[tuple[str, str, str], ...] = (
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvous.get_rdzv_state"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvousHandler.num_nodes_waiting"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "CONST_RUNID_SUBROOT_TTL"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "CONST_WORKER_KEEPALIVE_TTL"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "etcd.EtcdKeyNotFound"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "etcd.EtcdCompareFailed"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvous.handle_join_last_call"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvous.get_path"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "CONST_ETCD_JOINABLE_EPHEMERAL_TTL"),
    ("agent", "torch.distributed.elastic.agent.server.api", "SimpleElasticAgent.run"),
    ("agent", "torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._initialize_workers"),
    ("agent", "torch.distributed.elastic.agent.server.api", "WorkerState"),
    ("agent", "torch.distributed.elastic.agent.server.local_elastic_agent", "LocalElasticAgent._monitor_workers"),
    ("agent", "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
     "SubprocessHandler._popen"),
    ("agent", "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
     "SubprocessHandler.close"),
    ("checkpoints", "torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"),
    ("checkpoints", "torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader"),
    ("checkpoints", "torch.distributed._state_dict_utils", "_copy_state_dict"),
    ("checkpoints", "torch.distributed._state_dict_utils", "_create_cpu_state_dict"),
    ("checkpoints", "torch.distributed.checkpoint.filesystem", "narrow_tensor_by_index"),
    ("checkpoints", "torch.distributed.checkpoint.filesystem", "FileSystemReader._get_metadata_path"),
    ("checkpoints", "torch.distributed.checkpoint.filesystem", "FileSystemReader.read_data"),
    ("checkpoints", "torch._utils", "_rebuild_tensor_v2"),
    ("checkpoints", "torch.storage", "_get_dtype_from_pickle_storage_type"),
)

# (user, module, class, instance attribute, method that sets it): private state doeks' patches read on torch's
# objects; checked in the method's source (an attribute set on `self` there), where torch ships its sources.
STATE: tuple[tuple[str, str, str, str, str], ...] = (
    ("agent", "torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_worker_group", "__init__"),
    ("agent", "torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_remaining_restarts", "__init__"),
    ("agent", "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler", "SubprocessHandler",
     "_stdout", "__init__"),
    ("agent", "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler", "SubprocessHandler",
     "_stderr", "__init__"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvousHandler", "_rdzv_impl",
     "__init__"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvous", "_num_max_workers",
     "__init__"),
    ("rendezvous", "torch.distributed.elastic.rendezvous.etcd_rendezvous", "EtcdRendezvous", "client", "__init__"),
    ("checkpoints", "torch.distributed.checkpoint.filesystem", "FileSystemReader", "storage_data", "__init__"),
    ("checkpoints", "torch.distributed.checkpoint.filesystem", "FileSystemReader", "load_id", "__init__"),
)


class TorchMismatch(RuntimeError):
    """The running torch lacks a private name doeks uses: a torch doeks was not tested with."""


def missing(users: tuple[str, ...] | None = None) -> list[str]:
    """The names of NAMES and STATE (of these users; all when None) the running torch lacks, as module:path."""
    lacking = []
    for user, module_name, path in NAMES:
        if users is not None and user not in users:
            continue
        try:
            value = importlib.import_module(module_name)
            for part in path.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError):
            lacking.append(f"{module_name}:{path}")
    for user, module_name, class_name, attribute, method in STATE:
        if users is not None and user not in users:
            continue
        try:
            source = inspect.getsource(getattr(getattr(importlib.import_module(module_name), class_name), method))
        except (ImportError, AttributeError):
            lacking.append(f"{module_name}:{class_name}.{method}")
            continue
        except (OSError, TypeError):  # no sources shipped: nothing to read, the patches' own use will tell
            continue
        if f"self.{attribute}" not in source:
            lacking.append(f"{module_name}:{class_name}.{attribute}")
    return lacking


def check(users: tuple[str, ...] | None = None) -> None:
    """Raise TorchMismatch, one line naming the torch version and what it lacks, where the running torch lacks a
    private name doeks uses (of these users: "agent", "rendezvous", "checkpoints"; all when None)."""
    lacking = missing(users)
    if lacking:
        import torch

        shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        raise TorchMismatch(f"torch {torch.__version__} lacks what doeks patches or reads ({shown}); doeks is tested "
                            f"with torch {' and '.join(TESTED)}: use an image with it (TRAIN_BASE_IMAGE) or "
                            "`pip install torch==" + TESTED[-1] + "`")


def main() -> int:
    """`python3 -m doeks.pod.torchcompat`: one line, the running torch and whether doeks can patch and read it."""
    import sys

    try:
        check()
    except TorchMismatch as error:
        print(f"doeks: {error}", file=sys.stderr)
        return 1
    import torch

    print(f"doeks: torch {torch.__version__} has every private name doeks uses")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
