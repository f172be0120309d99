"""kubeflow: the Kubeflow platform, the training operator v1 (elastic PyTorchJobs), Trainer v2 TrainJobs (fixed size), and the
hybrid KFP v2 pipeline that picks kubernetes, sagemaker or local at run time.
"""
from invoke import Collection

from doeks.taskkit import Int, Unit, runner, settings, target, task


def _on_the_cluster(step, here: str, dry_run: bool) -> None:
    """Run a cluster step (step(settings, runner)) on the target's cluster; a target without one says why not."""
    target().on_cluster(step, here, runner(dry_run))


@task(name="deploy", help={"dry_run": "print the kustomization and the command; change nothing"})
def operator_deploy(c, dry_run=False):
    """Deploy the standalone training operator v1 (pinned) without MPIJob (the MPI operator owns it), server-side apply."""
    from doeks import kubeflow

    _on_the_cluster(kubeflow.operator_deploy, "PyTorchJobs are interpreted by doeks' local runtime; no operator to deploy", dry_run)


@task(name="delete", help={"dry_run": "print the command; change nothing"})
def operator_delete(c, dry_run=False):
    """Delete the training operator; safe to run twice."""
    from doeks import kubeflow

    _on_the_cluster(kubeflow.operator_delete, "no operator to delete", dry_run)


FRESH_HELP = "remove this job's old checkpoints and metrics first (else it resumes; doeks' own cluster)"


@task(help={"elastic": "add elasticPolicy (min:max replicas, rendezvous) as elasticjob does",
            "replicas": "nodes (elastic: Worker replicas; --no-elastic: 1 Master + N-1 Workers)", "fresh": FRESH_HELP,
            "dry_run": "print the PyTorchJob as YAML on stdout; change nothing"},
      flags={"replicas": Int(1, 1000)})
def submit(c, elastic=True, replicas=None, fresh=False, dry_run=False):
    """Submit a PyTorchJob running the repo's training script (kubectl server-side apply)."""
    from doeks import jobspec, kube

    where = target(settings(replicas=replicas))
    s = where.without_identity(where.settings)  # its pods have no AWS role of their own: checkpoints on the claim
    if not dry_run:
        where.require_cluster("PyTorchJobs", "use `invoke elasticjob.deploy`")
        from doeks import kueue

        kueue.require_local_queue(s)  # QUEUE set: the job waits in that queue, which must exist
    placement = where.placement()
    job = jobspec.pytorchjob(s, placement=placement) if elastic else jobspec.pytorchjob_fixed(s, placement=placement)
    _start_over(where, fresh, dry_run)
    _image_on_the_node(where, job, dry_run)
    kube.apply(runner(dry_run), [job])


def _start_over(where, fresh, dry_run):
    """--fresh: the job's checkpoints and metrics removed first, as `elasticjob.deploy --fresh` does (a job submitted
    again under its name resumes from its checkpoint: a finished one only says so). The target says whether the
    claim's folder is on this machine (doeks' own cluster), or refuses."""
    if not fresh:
        return
    step = where.fresh_step(where.settings.job_name)
    runner(dry_run).step(step.what, step.run)


def _image_on_the_node(where, job, dry_run):
    """The images the job's containers name, made available to the target's nodes (doeks' own cluster pulls nothing:
    the training image, built here, is imported into the node first)."""
    found = []
    for container in _containers(job):
        if container["image"] not in found:
            found.append(container["image"])
    where.ensure_images(runner(dry_run), found)


def _containers(manifest):
    if isinstance(manifest, dict):
        for key, value in manifest.items():
            if key == "containers" and isinstance(value, list):
                yield from value
            else:
                yield from _containers(value)
    elif isinstance(manifest, list):
        for item in manifest:
            yield from _containers(item)


@task(name="status")
def job_status(c):
    """Show the PyTorchJob."""
    from doeks import kube

    s = settings()
    kube.show(runner(), ["pytorchjob", s.job_name, "-n", s.namespace, "-o", "wide"])


@task(name="logs", help={"follow": "keep streaming"})
def job_logs(c, follow=False):
    """Logs of all the job's pods, prefixed."""
    from doeks import kube

    s = settings()
    kube.follow_logs(runner(), s.namespace, f"training.kubeflow.org/job-name={s.job_name}", follow=follow)


@task(name="delete", help={"dry_run": "print; change nothing"})
def job_delete(c, dry_run=False):
    """Delete the PyTorchJob; safe to run twice."""
    from doeks import jobspec, kube

    kube.delete(runner(dry_run), [jobspec.pytorchjob(settings(), image="-")])


@task(name="deploy", help={"dry_run": "print the commands; change nothing"})
def trainer_deploy(c, dry_run=False):
    """Deploy Kubeflow Trainer v2.3.0 alone (controller, JobSet, the torch-distributed runtime); kubeflow.deploy includes it."""
    from doeks import kubeflow

    _on_the_cluster(kubeflow.trainer_deploy, "no cluster for the Trainer; `invoke elasticjob.deploy` runs the job here", dry_run)


@task(name="delete", help={"dry_run": "print the commands; change nothing"})
def trainer_delete(c, dry_run=False):
    """Delete what kubeflow.trainer.deploy applied (runtimes first); safe to run twice."""
    from doeks import kubeflow

    _on_the_cluster(kubeflow.trainer_delete, "no Trainer to delete", dry_run)


@task(name="submit", help={"replicas": "nodes (trainer.numNodes; default REPLICAS)", "fresh": FRESH_HELP,
                           "dry_run": "print the TrainJob as YAML on stdout; change nothing"}, flags={"replicas": Int(1, 1000)})
def trainjob_submit(c, replicas=None, fresh=False, dry_run=False):
    """Submit the fixed-size job as a Trainer v2 TrainJob (torch-distributed runtime), server-side apply."""
    from doeks import kube, trainjob

    where = target(settings(replicas=replicas))
    s = where.without_identity(where.settings)  # its pods have no AWS role of their own: checkpoints on the claim
    if not dry_run:
        where.require_cluster("TrainJobs", "use `invoke elasticjob.deploy`")
        from doeks import kueue

        kueue.require_local_queue(s)  # QUEUE set: the job waits in that queue, which must exist
    from doeks import jobspec, ui

    if jobspec.idle_gpus_warning(s):  # GPUs per node follow the node
        ui.say(jobspec.idle_gpus_warning(s), style="yellow")
    job = trainjob.trainjob(s, placement=where.placement())
    _start_over(where, fresh, dry_run)
    where.grow_nodes(runner(dry_run), job["spec"]["trainer"]["numNodes"])  # EKS: GPU nodes start at 0
    _image_on_the_node(where, {"containers": [{"image": job["spec"]["trainer"]["image"]}]}, dry_run)
    trainjob.apply(runner(dry_run), job)


@task(name="status")
def trainjob_status(c):
    """Show the TrainJob and its JobSet's pods, and why it is not training when something is wrong.

    The reason line and its fix are those elasticjob.describe gives."""
    from doeks import kube, trainjob

    s = settings()
    kube.show(runner(), ["trainjob", s.job_name, "-n", s.namespace, "-o", "wide"])
    kube.show(runner(), ["pods", "-n", s.namespace, "-l", trainjob.selector(s.job_name), "-o", "wide"])
    from doeks import kueue, ui

    job = kube.get_json(["trainjob", s.job_name, "-n", s.namespace])
    queued = kueue.admission(job) if job else None
    if queued is not None:  # a job of a queue: admitted, or why it waits (Kueue's Workload)
        ui.say(queued.line(), style=None if queued.admitted else "yellow")
        if not queued.admitted:
            ui.say(f"fix: {kueue.waiting_fix(queued)}")
            return
    found = trainjob.diagnose(s)
    if found is not None:
        from doeks import ui

        ui.say(f"reason: {found.text}", style="red" if found.permanent else "yellow")
        ui.say(f"fix: {found.fix}")


@task(name="logs", help={"follow": "keep streaming"})
def trainjob_logs(c, follow=False):
    """Logs of all the TrainJob's pods, prefixed."""
    from doeks import kube, trainjob

    s = settings()
    kube.follow_logs(runner(), s.namespace, trainjob.selector(s.job_name), follow=follow)


@task(name="delete", help={"dry_run": "print; change nothing"})
def trainjob_delete(c, dry_run=False):
    """Delete the TrainJob (its JobSet and pods go with it); safe to run twice."""
    from doeks import kube, trainjob

    kube.delete(runner(dry_run), [trainjob.trainjob(settings())])  # kind, name and namespace are what delete reads


@task(name="compile", help={"out": "IR YAML path (default STATE_DIR/pipelines/hybrid-<runtime>.yaml)",
                            "runtime": "default for training_runtime: kubernetes, sagemaker or local",
                            "steps": "training steps (every branch; 0 = all epochs)"},
      flags={"steps": Int(0, 1_000_000_000)})  # the script's --max-steps: 0 = all epochs, below 0 meaningless
def pipeline_compile(c, out=None, runtime="kubernetes", steps=5):
    """Compile the hybrid pipeline to KFP v2 IR YAML with every parameter from .env (namespace, image, identity)."""
    from pathlib import Path

    from doeks import pipeline, ui

    s = settings()
    args = pipeline.arguments(s, runtime, int(steps), role=pipeline.role_arn(s, required=False))
    path = pipeline.compile_to(Path(out) if out else pipeline.default_path(s, runtime), pipeline.for_settings(s), args)
    ui.say(f"pipeline compiled to {path} (training_runtime default: {runtime}; namespace {s.kfp_namespace}, "
           f"service account {s.kfp_service_account})")
    if not args["sagemaker_role_arn"]:
        ui.warn(f"sagemaker_role_arn is empty (no AWS credentials or no role {s.sagemaker_role_name}): the sagemaker "
                "branch fails until it is given")
    print(path)


@task(name="run", help={"runtime": "kubernetes, sagemaker or local", "local": "execute here with kfp.local",
                        "steps": "training steps (0 = all epochs)", "dry_run": "print the arguments; change nothing"},
      flags={"steps": Int(0, 1_000_000_000)})
def pipeline_run(c, runtime="local", local=False, steps=5, dry_run=False):
    """Run the pipeline: on the (multi-user) Kubeflow Pipelines API at KFP_ENDPOINT, or here with --local."""
    import json
    import sys

    from doeks import aws, pipeline, ui

    s = settings()
    endpoint = (aws.endpoint_url(s) or "") if (local and runtime == "sagemaker") else ""
    role = pipeline.role_arn(s, required=runtime == "sagemaker" and not dry_run)
    args = pipeline.arguments(s, runtime, int(steps), endpoint_url=endpoint, role=role, here=local)
    if dry_run:
        shown = {k: (v if k != "source_tar_b64" else f"<{len(v)} base64 chars>") for k, v in args.items()}
        sys.stdout.write(json.dumps(shown, indent=2) + "\n")
        return
    if local:
        if runtime == "local":
            from doeks import elastic

            elastic.check_data(s)
        pipeline.run_local(s, args)
        ui.say(f"pipeline finished locally (training_runtime={runtime}); artifacts under {s.state_dir / 'kfp'}")
        return
    run_id = pipeline.create_run(s, args)
    ui.say(f"run {run_id} created on {s.kfp_endpoint} in namespace {s.kfp_namespace}")


@task(name="deploy", help={"dry_run": "print the Role, RoleBinding and AWS calls; change nothing"})
def pipeline_deploy(c, dry_run=False):
    """What the pipeline's pods need in the profile namespace: RBAC, SHARED_PVC, Pod Identity for SageMaker.

    RBAC on TrainJobs/PyTorchJobs; SHARED_PVC as a claim on the same file system."""
    from doeks import kube, pipeline

    where = target()

    def step(s, r):
        kube.apply(r, pipeline.rbac(s))
        pipeline.ensure_shared_claim(s, r)  # SHARED_PVC in KFP_NAMESPACE for the local and kubernetes branches
        where.identity_ensure(r, "pipeline-runner", f"no Pod Identity role for the sagemaker branch (an EKS feature); "
                              f"give {s.kfp_service_account} AWS credentials another way to run that branch")

    _on_the_cluster(step, "nothing to deploy; `invoke kubeflow.pipeline.run --local` runs the pipeline here", dry_run)


@task(name="delete", help={"dry_run": "print what would be deleted; change nothing",
                           "force": "ask for the profile's claim to go even while pods (the pipeline's finished "
                                    "jobs' too) still mount it"})
def pipeline_delete(c, dry_run=False, force=False):
    """Remove what kubeflow.pipeline.deploy made (Pod Identity, the profile's claim, RBAC); safe to run twice.

    A claim the pipeline's jobs' pods still mount is named and left (see csi.delete)."""
    where = target()
    _on_the_cluster(lambda s, r: _pipeline_remove(where, s, r, force), "nothing to delete", dry_run)


def _pipeline_remove(where, s, r, force: bool) -> None:
    from doeks import kube, pipeline

    where.identity_remove(r, "pipeline-runner")
    claim = pipeline.shared_claim_refs(s)  # deploy's steps in reverse: the claim, then the RBAC
    if claim:
        kube.delete_claim(r, s, s.kfp_namespace, s.shared_pvc, claim, force)
    kube.delete(r, pipeline.rbac(s))


@task(name="deploy", help={"dry_run": "print the commands; change nothing"})
def platform_deploy(c, dry_run=False):
    """Deploy Kubeflow from the pinned manifests: prerequisites, own password, server-side apply until settled, wait."""
    from doeks import kubeflow

    _on_the_cluster(kubeflow.deploy, "no cluster for Kubeflow; `invoke kubeflow.pipeline.run --local` runs the pipeline here", dry_run)


@task(help={"dry_run": "print the command; change nothing"})
def remove(c, dry_run=False):
    """Remove what kubeflow.deploy applied (waiting, bounded, until it is gone); safe to run twice."""
    from doeks import kubeflow

    _on_the_cluster(kubeflow.remove, "no Kubeflow platform to remove", dry_run)


@task(name="down")  # not in the collection: `invoke down`'s step (a task, so an error is one line and the others go on)
def _down(c, dry_run=False):
    """`invoke down`'s kubeflow step: what the pipeline's deploy made (its Pod Identity role outlives an EKS cluster),
    the training operator (`up`'s), then the Kubeflow platform when kubeflow.deploy installed it from this STATE_DIR
    (on EKS its claims are EBS volumes, which deleting the cluster first would leave behind)."""
    from doeks import kubeflow

    where = target()

    def step(s, r):
        _pipeline_remove(where, s, r, force=False)
        kubeflow.operator_delete(s, r)
        kubeflow.remove(s, r, on_down=True)

    where.on_cluster(step, "no operator to delete", runner(dry_run))


@task(name="status")
def platform_status(c):
    """Kubeflow's pods per namespace as a table."""
    from doeks import kubeflow, ui

    ui.table(f"Kubeflow {kubeflow.VERSION}", ["namespace", "pods", "running"], kubeflow.pod_rows(kubeflow.api_client()))


@task(help={"port": "local port for the dashboard"}, flags={"port": Int(1, 65535)})
def expose(c, port=8080):
    """Port-forward the Kubeflow dashboard (istio ingress gateway) to localhost (Ctrl-C to stop)."""
    from doeks import kube, ui

    ui.say(f"Kubeflow dashboard on http://localhost:{port} (user@example.com)")
    runner().run([kube.kubectl(), "port-forward", "-n", "istio-system", "svc/istio-ingressgateway", f"{port}:80"], mutating=False)


operator = Collection("training-operator", operator_deploy, operator_delete)
pytorchjob = Collection("pytorchjob", submit, job_status, job_logs, job_delete)
trainer_ns = Collection("trainer", trainer_deploy, trainer_delete)
trainjob_ns = Collection("trainjob", trainjob_submit, trainjob_status, trainjob_logs, trainjob_delete)
pipeline_ns = Collection("pipeline", pipeline_compile, pipeline_run, pipeline_deploy, pipeline_delete)
ns = Collection("kubeflow", platform_deploy, remove, platform_status, expose)
ns.add_collection(operator)
ns.add_collection(pytorchjob)
ns.add_collection(trainer_ns)
ns.add_collection(trainjob_ns)
ns.add_collection(pipeline_ns)
UNIT = Unit("kubeflow", order=50, up=operator_deploy, down=_down)
