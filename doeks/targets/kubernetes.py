"""TARGET=kubernetes: the manifests applied with kubectl (server-side apply) to the cluster in KUBECONFIG (KUBE_CONTEXT),
or to doeks' own single-node cluster when KUBECONFIG is empty; the Kubeflow training operator runs the PyTorchJob.
Status from the PyTorchJob's conditions and its pods; logs from `kubectl logs`.

TARGET=eks is this target plus what AWS adds (doeks.targets.eks): the image in ECR, GPUs and EFA of the node type,
artifacts copied to S3. Nothing here knows about AWS.
"""
from __future__ import annotations

from .. import kube
from ..cluster import volume as own
from ..errors import DoeksError
from .base import Target
from .kubejobs import KubernetesJobs


class KubernetesTarget(KubernetesJobs, Target):
    name = "kubernetes"
    builds_image = True

    def checks(self):
        from .checks import kubernetes_checks

        return kubernetes_checks(self.settings)

    def __init__(self, settings):
        super().__init__(settings)
        self.connect()

    # -- the units on a plain Kubernetes cluster: doeks' own (KUBECONFIG empty) or the user's --------------------------
    @property
    def own(self) -> bool:
        """doeks' own single-node cluster (KUBECONFIG empty, or its own kubeconfig), which runs on this machine."""
        return self.settings.own_cluster

    def connect(self) -> None:
        kube.use(self.settings)

    def after_up(self, dry_run: bool) -> None:
        if not dry_run:
            print(f"export KUBECONFIG={kube.kubeconfig_path(self.settings)}")

    def cluster_running(self) -> bool:
        return not own.stopped(self.settings)

    def cluster_create(self, runner) -> None:
        """doeks' own cluster started (KUBECONFIG empty), or the user's cluster checked; the KUBECONFIG line to export."""
        from ..cluster import lifecycle, versions

        s = self.settings
        if self.own:
            self.say(f"TARGET=kubernetes, KUBECONFIG empty: {'the plan for' if runner.dry_run else 'starting'} doeks' "
                     f"own {'single-node' if s.kube_nodes == 1 else f'{s.kube_nodes}-node'} cluster (Kubernetes "
                     f"v{versions.KUBERNETES})")
            path = lifecycle.up(runner, nodes=s.kube_nodes)
            self.sim_nodes(runner)
        else:
            if s.kube_sim_nodes:
                raise DoeksError(f"KUBE_SIM_NODES={s.kube_sim_nodes}: simulated nodes are added to doeks' own cluster "
                                 "only (KUBECONFIG is set): set KUBE_SIM_NODES=0 or KUBECONFIG empty")
            path = kube.kubeconfig_path(s)
            self.say(f"TARGET=kubernetes: using the cluster in {s.kubeconfig}"
                     + (f" (context {s.kube_context})" if s.kube_context else "") + "; nothing to create")
            if not runner.dry_run:
                kube.use(s)
                runner.run([kube.kubectl(), "get", "nodes"], mutating=False)
        if runner.dry_run:
            self.say(f"kubeconfig: {path}")   # stdout stays the plan's YAML stream
        else:
            print(f"export KUBECONFIG={path}")

    def sim_type(self) -> str:
        return self.settings.kube_sim_node_type or self.settings.gpu_instance_type

    def sim_nodes(self, runner) -> None:
        """KUBE_SIM_NODES simulated nodes of KUBE_SIM_NODE_TYPE (doeks.cluster.simnodes), in the zone EKS would put a
        GPU node group (EKS_ZONES' first, else the region's a); none beyond them."""
        from ..cluster import simnodes

        s = self.settings
        if runner.dry_run and not s.kube_sim_nodes:
            return
        zone = s.eks_zones[0] if s.eks_zones else f"{s.aws_region}a"
        simnodes.ensure(runner, s.kube_sim_nodes, self.sim_type(), s.aws_region, zone,
                        seed=f"{s.cluster_name}/{self.sim_type()}")

    def cluster_delete(self, runner, yes: bool = False) -> None:
        from ..cluster import lifecycle

        if not self.own:
            self.say(f"TARGET=kubernetes: the cluster in {self.settings.kubeconfig} is the user's; it keeps running")
            return
        self.say("TARGET=kubernetes: stopping doeks' own cluster (every process, mount, network namespace, iptables "
                 "rule, bridge and cgroup it made); built binaries and images stay cached")
        if not lifecycle.down(runner) and not runner.dry_run:
            self.say("doeks' cluster was not running")

    def cluster_status(self) -> None:
        from .. import ui
        from ..cluster import guard, lifecycle, versions

        if self.own:
            ui.table(f"doeks' cluster (Kubernetes v{versions.KUBERNETES})", ["component", "state", "pid", "log"],
                     lifecycle.status_rows())
            ui.say(f"network guard: {'installed' if guard.installed() else 'not installed'}, "
                   f"{guard.dropped()} packets dropped")

    def volume_deploy(self, runner) -> None:
        """The claim: on doeks' own cluster on a volume of this machine's folder; elsewhere of STORAGE_CLASS."""
        s = self.settings
        if self.own:
            from ..local import runtime

            folder = runtime.shared_volume(s)
            runner.step(f"create shared volume folder {folder}", folder.mkdir, parents=True, exist_ok=True)
        kube.use(s)
        claim = kube.shared_claim(s)
        own.move_volume(runner, s, claim)
        kube.apply(runner, claim)

    def volume_delete(self, runner, force: bool = False) -> None:
        """A claim a pod still uses is left in place with one line naming the pods (doeks' own cluster: asked to go
        without waiting, since `down` stops the cluster with them; --force: the same elsewhere)."""
        from ..local import runtime

        s = self.settings
        kube.use(s)
        if not runner.dry_run and own.stopped(s):
            self.say(f"doeks' cluster is not running: no claim on it; keeping {runtime.shared_volume(s)}")
            return
        # the claim first (claim protection: it goes once no pod uses it), then its volume; the folder stays
        kube.delete_claim(runner, s, s.namespace, s.shared_pvc, list(reversed(kube.shared_claim(s))), force)
        if self.own:
            self.say(f"keeping {runtime.shared_volume(s)} (data and checkpoints); remove it by hand if unwanted")

    def stage_data(self, runner, source: str, relayout_val: bool) -> None:
        from .. import storage

        storage.stage_on_cluster(self.settings, runner, source, relayout_val)

    def efa_deploy(self, runner) -> None:
        """doeks' own cluster: the MPI operator alone (no EFA there), built from its Go module and deployed from its
        manifest; a user's cluster: EFA is AWS's, nothing to deploy."""
        from .. import efa
        from ..cluster import operators

        if not self.own:
            self.nothing("EFA is an AWS network adapter; no device plugin to deploy on this cluster")
            return
        if not runner.dry_run and not self.cluster_running():
            self.say("doeks' cluster is not running: nothing to deploy on it (`TARGET=kubernetes invoke up` starts it)")
            return
        self.say("doeks' cluster: EFA is an AWS network adapter and this machine has none: the EFA device plugin is "
                 f"skipped; the MPI operator {efa.MPI_OPERATOR_VERSION} is deployed from its Go module's "
                 "deploy/v2beta1/mpi-operator.yaml")
        operators.ensure_images(operators.MPI_OPERATOR, runner)
        efa.mpi_operator_deploy(runner, _mpi_operator_manifest())

    def efa_delete(self, runner) -> None:
        from .. import efa

        if not self.own:
            self.nothing("no EFA device plugin was deployed; nothing to delete")
            return
        if not runner.dry_run and not self.cluster_running():
            self.say("doeks' cluster is not running: nothing on it to delete")
            return
        self.say("doeks' cluster: no EFA device plugin was deployed; deleting the MPI operator")
        efa.mpi_operator_delete(runner, _mpi_operator_manifest())

    def efa_status(self) -> None:
        from .. import efa
        from ..runner import Runner

        if not self.own:
            self.nothing("no EFA devices")
            return
        self.say("doeks' cluster: no EFA devices; the MPI operator:")
        kube.show(Runner(), ["deployment", "-n", efa.MPI_OPERATOR_NAMESPACE, efa.MPI_OPERATOR_DEPLOYMENT])

    def efa_test(self, runner, nodes: int | None, end: str | None) -> None:
        """The nccl-tests MPIJob; on doeks' own cluster the same MPIJob on CPU with a stand-in image (an MPI
        all-reduce over TCP), reported as such."""
        from .. import efa

        placement = self.placement()
        job = efa.nccl_mpijob(self.settings, nodes, end=end or efa.default_end(placement), placement=placement)
        if self.own:
            if not runner.dry_run and not self.cluster_running():
                raise DoeksError("doeks' cluster is not running: `TARGET=kubernetes invoke up` starts it")
            self.say(f"doeks' cluster: {efa.NCCL_TESTS_IMAGE} is doeks' stand-in (no registry, GPU or EFA here): an "
                     "MPI all-reduce on CPU over TCP, run by the MPI operator's launcher over ssh to its workers")
            from ..cluster import images

            images.nccl_tests_image(runner)
            if not runner.dry_run and runner.run([kube.kubectl(), "get", "crd", efa.MPIJOB_CRD], mutating=False,
                                                 check=False, capture=True).returncode != 0:
                raise DoeksError(f"the MPI operator is not deployed (no {efa.MPIJOB_CRD}): `invoke efa.deploy` deploys it")
        efa.run_test(self.settings, runner, job, placement.cpu)

    def metrics_deploy(self, runner, interval: int, agent: bool) -> None:
        self.nothing("GPU metrics go to CloudWatch, which is AWS's; nothing to deploy on this cluster")

    def metrics_status(self) -> None:
        self.nothing("no GPU-metrics agent (CloudWatch is AWS's)")

    def queue_flavors(self) -> list:
        """The node types of this cluster as Kueue flavors: doeks' own node (CPU only) and, with KUBE_SIM_NODES, the
        simulated type (its GPUs, EFA and EKS' topology labels, no CPU or memory quota; Kueue adds the toleration of
        their taint to the pods it places there); a user's cluster as one flavor of every node (GPU quota when
        KUBE_GPUS asks for GPUs)."""
        from .. import kueue

        s = self.settings
        if not self.own:
            return [kueue.Flavor("default", {}, gpus=s.kube_gpus)]
        from ..cluster import simnodes, versions

        flavors = [kueue.Flavor("doeks-node", {kueue.HOSTNAME: versions.NODE_NAME})]
        if s.kube_sim_nodes:
            simulated = kueue.node_type_flavor(self.sim_type(), tolerations=[simnodes.TOLERATION])
            # a job that asks for CPU or memory (this cluster's placement: it trains here) never goes to nodes that
            # run nothing; EKS' node-type placement asks for GPUs and EFA only, and fits there
            simulated.cpu_memory = False
            if simulated.topology:  # Kueue: jobs without a topology request use TAS flavors only in a TAS-only queue
                flavors[0].topology = kueue.NODE_TOPOLOGY
            flavors.append(simulated)
        return flavors

    def queue_base(self, runner) -> str | None:
        """Kueue's manifests: on doeks' own cluster the module's config/default (its image built and imported here;
        None when Kueue is not built), else the release's manifests.yaml."""
        from .. import kueue

        if not self.own:
            return kueue.RELEASE_MANIFESTS
        from ..cluster import operators

        if not operators.binary(operators.KUEUE).exists():  # the dry run says what `up` would do: no queue
            return None
        return str(operators.module_dir(operators.KUEUE) / operators.KUEUE.overlay)

    def _stopped(self, runner, words: str) -> bool:
        """doeks' own cluster is stopped (said, with `words`): nothing of a unit's can change or be read on it."""
        if self.own and not (runner is not None and runner.dry_run) and not self.cluster_running():
            self.say(f"doeks' cluster is not running: {words}")
            return True
        return False

    def queue_deploy(self, runner) -> None:
        from .. import kueue

        if self._stopped(runner, "nothing to deploy on it (`TARGET=kubernetes invoke up` starts it)"):
            return
        base = self.queue_base(runner)
        if base is None:
            self.say(f"doeks' cluster: Kueue {kueue.VERSION} is not built (`invoke setup --kueue` builds it and kwok): "
                     "no queue here, jobs start at once")
            return
        if self.own:
            from ..cluster import operators

            operators.kueue_image(runner)
        kueue.deploy(self.settings, runner, base, self.queue_flavors(), own=self.own)

    def queue_delete(self, runner) -> None:
        from .. import kueue

        if self._stopped(runner, "no Kueue on it"):
            return
        base = self.queue_base(runner)
        if base is None:
            from ..cluster import operators

            base = str(operators.module_dir(operators.KUEUE) / operators.KUEUE.overlay)
        kueue.delete(self.settings, runner, base, own=self.own)

    def queue_status(self) -> None:
        from .. import kueue

        if self._stopped(None, "no queue"):
            return
        kueue.status_tables(self.settings)

    def on_cluster(self, step, here: str, runner) -> None:
        if not runner.dry_run and not self.cluster_running():
            self.say("doeks' cluster is not running: nothing on it to change (`TARGET=kubernetes invoke up` starts it)")
            return
        step(self.settings, runner)

    def require_cluster(self, what: str, hint: str) -> None:
        return None


def _mpi_operator_manifest() -> str:
    """The MPI operator's manifest on doeks' own cluster (no network): upstream's file inside the operator's Go module
    at the pinned version (doeks.cluster.operators)."""
    from ..cluster import operators

    op = operators.MPI_OPERATOR
    return str(operators.module_dir(op) / op.overlay)
