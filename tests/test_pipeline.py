"""The hybrid KFP pipeline's contract: what each compiled pipeline carries (namespace, image, identity from .env; no
made-up account), what its kubernetes branch creates and where (a fake CustomObjectsApi that answers like the API
server: 409 on a name it has, conditions), what its sagemaker branch sends (a real moto server), which identity the
pipeline's pods get (Role + Pod Identity), and that `pipeline.run` logs in to a multi-user KFP (a stand-in KFP API)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import boto3
import jsonschema
import pytest
import yaml

from doeks import identity, pipeline
from doeks import settings as S

from .conftest import invoke
from .test_csi import cloud  # noqa: F401 - moto + an EKS cluster
from .test_identity import planned_calls
from .test_jobspec import crd_schema
from .test_kubeflow_sagemaker import boto, moto_env  # noqa: F401 - the moto server fixture
from .test_trainjob import validate as validate_trainjob

IMAGE_ENV = {"REGISTRY": "registry.example.com", "KFP_NAMESPACE": "team-a", "KFP_SERVICE_ACCOUNT": "team-runner"}


def compiled(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    ir, platform = docs[0], (docs[1] if len(docs) > 1 else {})
    params = {k: v.get("defaultValue") for k, v in ir["root"]["inputDefinitions"]["parameters"].items()}
    return ir, platform, params


@pytest.mark.parametrize("runtime,kind", [("kubernetes", "trainjob"), ("kubernetes", "pytorchjob"), ("sagemaker", "trainjob"),
                                          ("local", "pytorchjob")])
def test_compiled_pipeline_carries_namespace_image_and_identity_from_settings(runtime, kind, state_dir):
    result = invoke("kubeflow.pipeline.compile", "--runtime", runtime, env={**IMAGE_ENV, "PIPELINE_JOB_KIND": kind})
    assert result.returncode == 0, result.stderr
    path = state_dir / "pipelines" / f"hybrid-{runtime}.yaml"  # under STATE_DIR, not the repo root
    assert result.stdout.strip() == str(path)
    text = path.read_text()
    assert "000000000000" not in text and "<account>" not in text
    ir, platform, params = compiled(path)
    assert params["training_runtime"] == runtime and params["namespace"] == "team-a"
    # the local branch runs in the training image (torch and the script), the cluster job names the same image
    executors = ir["deploymentSpec"]["executors"]
    image = executors["exec-train-local"]["container"]["image"]
    assert image.startswith("registry.example.com/doeks-train:")
    job = json.loads(params["job"])
    assert job["metadata"]["namespace"] == "team-a"
    if kind == "trainjob":
        assert job["kind"] == "TrainJob" and job["spec"]["trainer"]["image"] == image
        validate_trainjob(job)
    else:
        assert job["kind"] == "PyTorchJob" and "elasticPolicy" not in job["spec"]  # fixed size: no etcd to manage
        assert "Master" in job["spec"]["pytorchReplicaSpecs"]
        assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] == image
        jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1"))
    # every task's pod runs as the profile's service account (the one with RBAC and the Pod Identity association)
    accounts = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(accounts) == set(executors) and {a["serviceAccount"] for a in accounts.values()} == {"team-runner"}
    # the local branch's pod reads the data from the shared volume (the kubernetes branch's job mounts it itself)
    assert [(m["pvcNameParameter"]["runtimeValue"]["constant"], m["mountPath"]) for m in accounts["exec-train-local"]["pvcMount"]] \
        == [("fsx-pvc", "/fsx-shared")]
    assert params["data_dir"] == "/fsx-shared/data"
    request = json.loads(params["sagemaker_request"])
    assert "RoleArn" not in request and params["sagemaker_role_arn"] == ""  # no credentials here: left empty
    assert request["AlgorithmSpecification"]["TrainingImage"] == S.load().sagemaker_image


def test_compile_refuses_an_image_it_cannot_name(state_dir, tmp_path):
    out = tmp_path / "p.yaml"
    result = invoke("kubeflow.pipeline.compile", "--out", str(out))
    assert result.returncode == 1 and result.stderr.startswith("error: cannot tell which ECR registry")
    assert "Traceback" not in result.stderr and not out.exists()


def test_compile_reads_the_execution_role_arn_from_iam(moto_env, state_dir, tmp_path):  # noqa: F811
    arn = boto(moto_env, "iam").create_role(RoleName="doeks-sagemaker-execution-us-west-2", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    out = tmp_path / "p.yaml"
    result = invoke("kubeflow.pipeline.compile", "--runtime", "sagemaker", "--out", str(out), env=moto_env)
    assert result.returncode == 0, result.stderr
    _, _, params = compiled(out)
    assert params["sagemaker_role_arn"] == arn and ":123456789012:" in arn
    assert compiled(out)[0]["deploymentSpec"]["executors"]["exec-train-local"]["container"]["image"].startswith(
        "123456789012.dkr.ecr.us-west-2.amazonaws.com/doeks-train:")


# -- the kubernetes branch, without a cluster -------------------------------------------------------------------------
class FakeCustomObjects:
    """CustomObjectsApi as the API server answers it: 409 for a name it holds; the job's conditions per poll."""

    def __init__(self, store, conditions):
        self.store, self.conditions = store, conditions

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        from kubernetes.client.exceptions import ApiException

        key = (group, version, namespace, plural, body["metadata"]["name"])
        if key in self.store:
            raise ApiException(status=409, reason="AlreadyExists")
        self.store[key] = body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        body = dict(self.store[(group, version, namespace, plural, name)])
        body["status"] = {"conditions": self.conditions.pop(0) if len(self.conditions) > 1 else self.conditions[0]}
        return body


@pytest.fixture
def cluster(monkeypatch):
    import kubernetes

    store, conditions = {}, [[{"type": "Created", "status": "True"}]]
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda: FakeCustomObjects(store, conditions))
    return SimpleNamespace(store=store, conditions=conditions)


def model():
    return SimpleNamespace(metadata={}, uri="", path="")


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_kubernetes_branch_creates_one_job_per_run_in_the_namespace_with_steps(kind, cluster, state_dir, monkeypatch):
    monkeypatch.setenv("REGISTRY", "registry.example.com")
    monkeypatch.setenv("KFP_NAMESPACE", "team-a")
    monkeypatch.setenv("PIPELINE_JOB_KIND", kind)
    s = S.load()
    args = pipeline.arguments(s, "kubernetes", steps=7)
    done = "Complete" if kind == "trainjob" else "Succeeded"
    names = []
    for run in ("0f3c2a55-run-a", "7d1e9b20-run-b"):
        cluster.conditions[:] = [[{"type": "Created", "status": "True"}], [{"type": done, "status": "True"}]]
        out = model()
        pipeline.train_kubernetes(job=args["job"], namespace=args["namespace"], steps=7, run_id=run, model=out, poll_seconds=0)
        names.append(out.metadata["name"])
        assert out.metadata["namespace"] == "team-a"
    assert len(set(names)) == 2  # the second run does not meet the first one's name (409 before)
    jobs = list(cluster.store.values())
    assert [j["metadata"]["namespace"] for j in jobs] == ["team-a", "team-a"]
    for job, name in zip(jobs, names):
        if kind == "trainjob":
            argv = job["spec"]["trainer"]["args"]
            validate_trainjob(job)
        else:
            argv = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"]
            jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1"))
        assert argv[-2:] == ["--max-steps", "7"]  # `steps` reaches the script
        # the run's own checkpoints: an earlier run's finished checkpoint would end this one at once
        assert argv[argv.index("--checkpoint-dir") + 1] == f"{s.shared_mount}/checkpoints/{name}"
        assert argv[argv.index("--metrics-dir") + 1] == f"{s.shared_mount}/metrics/{name}"
        assert len(name) <= 63 and name[0].isalpha()


def test_kubernetes_branch_follows_its_own_job_on_a_retry_and_fails_with_the_job(cluster, state_dir, monkeypatch):
    monkeypatch.setenv("REGISTRY", "registry.example.com")
    args = pipeline.arguments(S.load(), "kubernetes")
    cluster.conditions[:] = [[{"type": "Complete", "status": "True"}]]
    for _ in range(2):  # the same run's task retried: the job it made is followed, not a 409
        pipeline.train_kubernetes(job=args["job"], namespace="team-a", steps=1, run_id="run-x", model=model(), poll_seconds=0)
    assert len(cluster.store) == 1
    cluster.conditions[:] = [[{"type": "Failed", "status": "True", "message": "node-0 OOMKilled"}]]
    with pytest.raises(RuntimeError, match="failed: node-0 OOMKilled"):
        pipeline.train_kubernetes(job=args["job"], namespace="team-a", steps=1, run_id="run-y", model=model(), poll_seconds=0)
    with pytest.raises(RuntimeError, match="not a TrainJob or PyTorchJob"):
        pipeline.train_kubernetes(job="{}", namespace="team-a", steps=1, run_id="run-z", model=model(), poll_seconds=0)


def test_unresolved_run_id_still_gives_unique_names(cluster, state_dir, monkeypatch):
    monkeypatch.setenv("REGISTRY", "registry.example.com")
    args = pipeline.arguments(S.load(), "kubernetes")
    cluster.conditions[:] = [[{"type": "Complete", "status": "True"}]]
    for _ in range(2):
        pipeline.train_kubernetes(job=args["job"], namespace="team-a", steps=1, run_id="{{$.pipeline_job_uuid}}",
                                  model=model(), poll_seconds=0)
    assert len(cluster.store) == 2


# -- the sagemaker branch against moto ----------------------------------------------------------------------------------
def test_sagemaker_branch_sends_the_request_from_settings(moto_env, state_dir, monkeypatch):  # noqa: F811
    for key, value in moto_env.items():
        monkeypatch.setenv(key, value)
    iam, s3 = boto(moto_env, "iam"), boto(moto_env, "s3")
    s3.create_bucket(Bucket="doeks-training", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    s = S.load()
    with pytest.raises(RuntimeError, match="sagemaker_role_arn is empty"):  # no made-up ARN: a clear failure
        args = pipeline.arguments(s, "sagemaker", steps=4, endpoint_url=moto_env["AWS_ENDPOINT_URL"], role=pipeline.role_arn(s, False))
        pipeline.train_sagemaker(request=args["sagemaker_request"], role_arn=args["sagemaker_role_arn"], steps=4, run_id="r0",
                                 source_tar_b64=args["source_tar_b64"], region="us-west-2", endpoint_url=moto_env["AWS_ENDPOINT_URL"],
                                 model=model(), poll_seconds=0)
    arn = iam.create_role(RoleName=s.sagemaker_role_name, AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    args = pipeline.arguments(s, "sagemaker", steps=4, endpoint_url=moto_env["AWS_ENDPOINT_URL"], role=pipeline.role_arn(s, True))
    names = []
    for run in ("run-a", "run-b"):
        out = model()
        pipeline.train_sagemaker(request=args["sagemaker_request"], role_arn=args["sagemaker_role_arn"], steps=4, run_id=run,
                                 source_tar_b64=args["source_tar_b64"], region="us-west-2",
                                 endpoint_url=moto_env["AWS_ENDPOINT_URL"], model=out, poll_seconds=0)
        names.append(out.metadata["training_job"])
        assert out.uri.startswith(f"s3://doeks-training/doeks/{names[-1]}/output")
    assert len(set(names)) == 2
    sm = boto(moto_env, "sagemaker")
    for name in names:
        job = sm.describe_training_job(TrainingJobName=name)
        assert job["RoleArn"] == arn
        assert job["AlgorithmSpecification"]["TrainingImage"] == s.sagemaker_image
        assert job["HyperParameters"]["max-steps"] == "4" and job["HyperParameters"]["arch"] == s.arch
        source = job["HyperParameters"]["sagemaker_submit_directory"]
        assert source == f"s3://doeks-training/doeks/{name}/source/sourcedir.tar.gz"
        assert s3.head_object(Bucket="doeks-training", Key=source.split("doeks-training/", 1)[1])["ContentLength"] > 0
        assert job["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == f"s3://doeks-training/{s.data_s3_prefix}/"
        assert job["OutputDataConfig"]["S3OutputPath"] == f"s3://doeks-training/doeks/{name}/output"
        assert job["ResourceConfig"]["InstanceType"] == s.sagemaker_instance_type


# -- the pipeline's identity --------------------------------------------------------------------------------------------
def test_pipeline_runner_policy_is_scoped_and_its_calls_exist(state_dir, monkeypatch):
    import botocore.session

    monkeypatch.setenv("KFP_NAMESPACE", "team-a")
    monkeypatch.setenv("KFP_SERVICE_ACCOUNT", "team-runner")
    s = S.load()
    row = identity.get("pipeline-runner")
    assert (row.ns(s), row.sa(s)) == ("team-a", "team-runner")
    docs = identity.policies(s, row)
    session = botocore.session.get_session()
    for action in row.calls:
        service, operation = action.split(":")
        if action == "iam:PassRole":  # a permission only, no API operation (IAM service authorization reference)
            continue
        model = session.get_service_model({"sagemaker": "sagemaker", "s3": "s3"}[service])
        assert operation in model.operation_names, action
    job = "arn:aws:sagemaker:us-west-2:123456789012:training-job/imagenet-1a2b3c4d"
    for action in ("sagemaker:CreateTrainingJob", "sagemaker:DescribeTrainingJob", "sagemaker:StopTrainingJob", "sagemaker:AddTags"):
        assert identity.allows(docs, action, job)
    assert not identity.allows(docs, "sagemaker:CreateTrainingJob", "arn:aws:sagemaker:us-west-2:123456789012:training-job/other-1")
    assert not identity.allows(docs, "sagemaker:CreateEndpoint", job)
    assert identity.allows(docs, "iam:PassRole", f"arn:aws:iam::123456789012:role/{s.sagemaker_role_name}")
    assert not identity.allows(docs, "iam:PassRole", "arn:aws:iam::123456789012:role/admin")
    passrole = next(st for st in docs[0]["Statement"] if st["Action"] == "iam:PassRole")
    assert passrole["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
    assert identity.allows(docs, "s3:PutObject", "arn:aws:s3:::doeks-training/doeks/imagenet-1/source/sourcedir.tar.gz")
    assert not identity.allows(docs, "s3:PutObject", "arn:aws:s3:::doeks-training/data/imagenet/x")


def test_pipeline_deploy_dry_run_shows_rbac_and_the_association(cloud, state_dir):  # noqa: F811
    env = {**cloud["env"], **IMAGE_ENV}
    result = invoke("kubeflow.pipeline.deploy", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    role = next(d for d in docs if d["kind"] == "Role")
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert role["metadata"]["namespace"] == "team-a"
    granted = {(g, r) for rule in role["rules"] if "create" in rule["verbs"] and "get" in rule["verbs"]
               for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("trainer.kubeflow.org", "trainjobs"), ("kubeflow.org", "pytorchjobs")} <= granted
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "team-runner", "namespace": "team-a"}]
    planned = planned_calls(result.stderr, "create_pod_identity_association")
    assert [(p["namespace"], p["serviceAccount"]) for p in planned] == [("team-a", "team-runner")]
    assert planned[0]["roleArn"].endswith("role/doeks-doeks-us-west-2-pipeline-runner")
    assert not [r for r in boto3.client("iam", **cloud["kw"]).list_roles()["Roles"] if r["RoleName"].startswith("doeks-")]


# -- pipeline.run against a multi-user KFP API (stand-in) -----------------------------------------------------------------
@pytest.fixture
def kfp_api():
    """The three KFP v2beta1 calls create_run_from_pipeline_func makes; requests recorded with their headers."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            seen.append({"method": "GET", "path": self.path, "auth": self.headers.get("Authorization"), "body": None})
            self._reply({})

        def do_POST(self):  # noqa: N802
            if self.headers.get("Authorization") == "Bearer expired":
                self.send_response(401)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            seen.append({"method": "POST", "path": self.path, "auth": self.headers.get("Authorization"),
                         "cookie": self.headers.get("Cookie"), "body": body})
            if self.path.endswith("/experiments"):
                self._reply({"experiment_id": "exp-1", "display_name": body.get("display_name"), "namespace": body.get("namespace")})
            else:
                self._reply({"run_id": "run-1", "experiment_id": "exp-1", "display_name": body.get("display_name")})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{server.server_port}", seen=seen)
    server.shutdown()


def test_pipeline_run_logs_in_to_a_multi_user_kfp(kfp_api, state_dir):
    token = "eyJhbGciOiJSUzI1NiJ9.secret-token-value"
    env = {**IMAGE_ENV, "TARGET": "eks", "KFP_ENDPOINT": kfp_api.url}
    refused = invoke("kubeflow.pipeline.run", "--runtime", "kubernetes", env=env)
    assert refused.returncode == 1 and "KFP_TOKEN" in refused.stderr and "Traceback" not in refused.stderr
    assert kfp_api.seen == []
    result = invoke("kubeflow.pipeline.run", "--runtime", "kubernetes", env={**env, "KFP_TOKEN": token})
    assert result.returncode == 0, result.stderr
    assert "run run-1 created" in result.stderr
    assert token not in result.stdout + result.stderr
    assert kfp_api.seen and all(r["auth"] == f"Bearer {token}" for r in kfp_api.seen)
    experiment = next(r for r in kfp_api.seen if r["method"] == "POST" and r["path"].endswith("/experiments"))
    assert experiment["body"]["namespace"] == "team-a"
    run = next(r for r in kfp_api.seen if r["path"].endswith("/runs"))["body"]
    assert run["service_account"] == "team-runner"
    assert run["runtime_config"]["parameters"]["namespace"] == "team-a"
    assert run["runtime_config"]["parameters"]["training_runtime"] == "kubernetes"
    spec = run["pipeline_spec"]  # with a platform spec, KFP takes {pipeline_spec, platform_spec}
    assert spec["pipeline_spec"]["deploymentSpec"]["executors"]["exec-train-local"]["container"]["image"].startswith("registry.example.com/")
    accounts = spec["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert {a["serviceAccount"] for a in accounts.values()} == {"team-runner"}
    cookie = invoke("kubeflow.pipeline.run", "--runtime", "kubernetes", env={**env, "KFP_SESSION_TOKEN": "abc123cookie"})
    assert cookie.returncode == 0, cookie.stderr
    assert kfp_api.seen[-1]["cookie"] == "oauth2_proxy_kubeflow=abc123cookie"
    expired = invoke("kubeflow.pipeline.run", "--runtime", "kubernetes", env={**env, "KFP_TOKEN": "expired"})
    assert expired.returncode == 1 and "Traceback" not in expired.stderr
    assert expired.stderr.strip().splitlines()[-1].startswith("error: Kubeflow Pipelines at") and "401" in expired.stderr
    gone = invoke("kubeflow.pipeline.run", "--runtime", "kubernetes", env={**env, "KFP_TOKEN": token, "KFP_ENDPOINT": "http://127.0.0.1:9"})
    assert gone.returncode == 1 and "cannot reach Kubeflow Pipelines" in gone.stderr and "Traceback" not in gone.stderr


def test_pipeline_deploy_then_delete_twice_leaves_no_role_or_association(cloud, state_dir):  # noqa: F811
    from .test_csi import recorded

    env = {**cloud["env"], **IMAGE_ENV}
    assert invoke("kubeflow.pipeline.deploy", env=env).returncode == 0
    eks, iam = boto3.client("eks", **cloud["kw"]), boto3.client("iam", **cloud["kw"])
    found = eks.list_pod_identity_associations(clusterName="doeks", namespace="team-a", serviceAccount="team-runner")["associations"]
    assert len(found) == 1
    role = iam.get_role(RoleName="doeks-doeks-us-west-2-pipeline-runner")["Role"]
    assert eks.describe_pod_identity_association(clusterName="doeks", associationId=found[0]["associationId"])["association"]["roleArn"] == role["Arn"]
    policy = iam.get_role_policy(RoleName="doeks-doeks-us-west-2-pipeline-runner", PolicyName="doeks-pipeline-runner")["PolicyDocument"]
    assert identity.allows([policy], "sagemaker:CreateTrainingJob", "arn:aws:sagemaker:us-west-2:123456789012:training-job/imagenet-0")
    applied = [d["kind"] for c in recorded(cloud) if c["tool"] == "kubectl" and "apply" in c["argv"]
               for d in yaml.safe_load_all(c["stdin"]) if d]
    assert applied == ["Role", "RoleBinding"]
    for _ in range(2):
        result = invoke("kubeflow.pipeline.delete", env=env)
        assert result.returncode == 0, result.stderr
    assert not eks.list_pod_identity_associations(clusterName="doeks")["associations"]
    assert "doeks-doeks-us-west-2-pipeline-runner" not in [r["RoleName"] for r in iam.list_roles()["Roles"]]
    deleted = [d["kind"] for c in recorded(cloud) if c["tool"] == "kubectl" and "delete" in c["argv"]
               for d in yaml.safe_load_all(c["stdin"]) if d]
    # the profile namespace's claim on the shared file system (and its volume: Retain, the data stays), then the RBAC
    assert deleted == ["PersistentVolumeClaim", "PersistentVolume", "Role", "RoleBinding"] * 2
