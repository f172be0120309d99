#!/usr/bin/env python3
"""Stand-ins for eksctl and kubectl/helm that act on the moto server (no EKS, no cluster here), closer to what a real
account does than tests/eksctl_standin.py: `eksctl create cluster` makes the VPC (tagged, 2 private + 1 public
subnets, a cluster security group), the cluster and its node groups; `eksctl delete cluster` deletes them and, like
eksctl's CloudFormation stack, FAILS with DependencyViolation while anything doeks made still sits in the VPC
(security groups, VPC endpoints, EFS mount targets, FSx file systems). kubectl/helm record their argv + stdin to
$RECORD; `kubectl get pods -o json` answers from $PODS (a JSON list, default none; `-n` picks a pod's namespace, a
pod without one is in every namespace), `kubectl get namespace NAME` from $NAMESPACES (a JSON object: name -> labels; NotFound otherwise, as the API server says it), `kubectl get crd NAME` NotFound; `kubectl delete` of the shared
claim does what the FSx CSI driver's DeleteVolume does: deletes the file systems it made (tag doeks/cluster).
`kubectl get jobs` answers from $JOBS (a JSON list, default none); deleting a Job takes it out of $JOBS and its pods
(label batch.kubernetes.io/job-name) out of $PODS, as the garbage collector's foreground deletion does. A waiting
delete of a claim that a pod in $PODS holds (scheduled on a node, finished or not: claim protection, as
tests/test_rehearsal_cluster.py shows on a real API server) fails at once with kubectl's timeout message, where a
real kubectl would wait until --timeout (for ever without one).
Whatever it runs as is chosen by its file name (eksctl, kubectl, helm).
"""
import json
import os
import sys

import boto3
import yaml

tool, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
KW = dict(endpoint_url=os.environ["AWS_ENDPOINT_URL"], aws_access_key_id="testing", aws_secret_access_key="testing")


def flag(name):
    return argv[argv.index(name) + 1]


def client(service, region):
    return boto3.client(service, region_name=region, **KW)


def eksctl():
    with open(os.environ["RECORD"], "a") as record:
        record.write(json.dumps({"tool": "eksctl", "argv": argv, "stdin": ""}) + "\n")
    if argv[:2] == ["create", "cluster"]:
        config = yaml.safe_load(open(flag("-f")))
        meta, region = config["metadata"], config["metadata"]["region"]
        ec2, eks = client("ec2", region), client("eks", region)
        tags = [{"Key": k, "Value": v} for k, v in {**meta.get("tags", {}), "alpha.eksctl.io/cluster-name": meta["name"]}.items()]
        vpc = ec2.create_vpc(CidrBlock=config["vpc"]["cidr"], TagSpecifications=[{"ResourceType": "vpc", "Tags": tags}])["Vpc"]["VpcId"]
        base = config["vpc"]["cidr"].rsplit(".", 2)[0]
        # eksctl makes a subnet pair in each of the config's zones (its own picks when there are none)
        zones = config.get("availabilityZones") or [f"{region}a", f"{region}b"]
        private = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"{base}.{i}.0/24", AvailabilityZone=z)["Subnet"]["SubnetId"]
                   for i, z in enumerate(zones[:2], start=1)]
        public = ec2.create_subnet(VpcId=vpc, CidrBlock=f"{base}.3.0/24", AvailabilityZone=zones[0])["Subnet"]["SubnetId"]
        ec2.modify_subnet_attribute(SubnetId=public, MapPublicIpOnLaunch={"Value": True})
        group = ec2.create_security_group(GroupName=f"eks-cluster-sg-{meta['name']}", Description="cluster", VpcId=vpc)["GroupId"]
        eks.create_cluster(name=meta["name"], version=meta["version"], roleArn="arn:aws:iam::123456789012:role/eks",
                           resourcesVpcConfig={"subnetIds": private + [public], "securityGroupIds": [group]}, tags=meta.get("tags", {}))
        for ng in config["managedNodeGroups"]:
            eks.create_nodegroup(clusterName=meta["name"], nodegroupName=ng["name"], instanceTypes=[ng["instanceType"]],
                                 scalingConfig={"minSize": ng["minSize"], "desiredSize": ng["desiredCapacity"], "maxSize": ng["maxSize"]},
                                 subnets=private, nodeRole="arn:aws:iam::123456789012:role/node", labels=ng.get("labels", {}))
    elif argv[:2] == ["delete", "cluster"]:
        region, name = flag("--region"), flag("--name")
        ec2, eks = client("ec2", region), client("eks", region)
        cluster = eks.describe_cluster(name=name)["cluster"]
        vpc = ec2.describe_subnets(SubnetIds=cluster["resourcesVpcConfig"]["subnetIds"][:1])["Subnets"][0]["VpcId"]
        for ng in eks.list_nodegroups(clusterName=name)["nodegroups"]:
            eks.delete_nodegroup(clusterName=name, nodegroupName=ng)
        eks.delete_cluster(name=name)
        subnets = [s["SubnetId"] for s in ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"]]
        blocking = [g["GroupName"] for g in ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
                    if g["GroupName"] != "default" and g["GroupId"] not in cluster["resourcesVpcConfig"]["securityGroupIds"]]
        blocking += [e["VpcEndpointId"] for e in ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["VpcEndpoints"]
                     if e.get("State", "").lower() not in ("deleted", "deleting")]
        efs = client("efs", region)
        for fs in efs.describe_file_systems()["FileSystems"]:
            blocking += [m["MountTargetId"] for m in efs.describe_mount_targets(FileSystemId=fs["FileSystemId"])["MountTargets"]
                         if m["SubnetId"] in subnets]
        blocking += [f["FileSystemId"] for f in client("fsx", region).describe_file_systems()["FileSystems"]
                     if set(f.get("SubnetIds", [])) & set(subnets)]
        if blocking:
            sys.stderr.write(f"Error: deleting VPC {vpc}: DependencyViolation: still in use by {', '.join(blocking)}\n")
            sys.exit(1)
        for group in cluster["resourcesVpcConfig"]["securityGroupIds"]:
            ec2.delete_security_group(GroupId=group)
        for subnet in subnets:
            ec2.delete_subnet(SubnetId=subnet)
        ec2.delete_vpc(VpcId=vpc)


def _load(name):
    path = os.environ.get(name)
    return json.load(open(path)) if path and os.path.exists(path) else []


def _save(name, items):
    path = os.environ.get(name)
    if path and os.path.exists(path):
        with open(path, "w") as f:
            json.dump(items, f)


def kube():
    stdin = sys.stdin.read() if "-f" in argv and "-" in argv else ""
    with open(os.environ["RECORD"], "a") as record:
        record.write(json.dumps({"tool": tool, "argv": argv, "stdin": stdin}) + "\n")
    if tool == "kubectl" and argv[:2] == ["get", "pods"]:
        namespace = flag("-n") if "-n" in argv else None  # a pod without a namespace is in every one
        print(json.dumps({"items": [p for p in _load("PODS") if namespace in (None, p["metadata"].get("namespace", namespace))]}))
    if tool == "kubectl" and argv[:2] == ["get", "job"]:  # the staging Job: it completes here (no S3 to read)
        print(json.dumps({"kind": "Job", "metadata": {"name": argv[2]},
                          "status": {"conditions": [{"type": "Complete", "status": "True"}]}}))
    if tool == "kubectl" and argv[:2] == ["get", "jobs"]:
        print(json.dumps({"items": _load("JOBS")}))
    if tool == "kubectl" and argv[:2] == ["get", "crd"]:  # no operator's CRDs on this stand-in cluster (Kueue's: not deployed)
        sys.stderr.write(f'Error from server (NotFound): customresourcedefinitions.apiextensions.k8s.io "{argv[2]}" not found\n')
        sys.exit(1)
    if tool == "kubectl" and argv[:2] == ["get", "namespace"]:
        known = os.environ.get("NAMESPACES")
        found = json.load(open(known)) if known and os.path.exists(known) else {}
        if argv[2] not in found:
            sys.stderr.write(f'Error from server (NotFound): namespaces "{argv[2]}" not found\n')
            sys.exit(1)
        print(json.dumps({"kind": "Namespace", "metadata": {"name": argv[2], "labels": found[argv[2]]}}))
    if tool == "kubectl" and argv[:1] == ["delete"]:
        docs = [d for d in yaml.safe_load_all(stdin) if d]
        gone = {d["metadata"]["name"] for d in docs if d.get("kind") == "Job"}
        if gone:  # foreground: the Job goes with its pods
            _save("JOBS", [j for j in _load("JOBS") if j["metadata"]["name"] not in gone])
            _save("PODS", [p for p in _load("PODS")
                           if p["metadata"].get("labels", {}).get("batch.kubernetes.io/job-name") not in gone])
        claims = [d for d in docs if d.get("kind") == "PersistentVolumeClaim"]
        held = [p["metadata"]["name"] for p in _load("PODS") for c in claims
                if (p.get("spec", {}).get("nodeName") or p.get("status", {}).get("phase") not in ("Succeeded", "Failed"))
                and p["metadata"].get("namespace", "default") == c["metadata"].get("namespace", "default")
                and any(v.get("persistentVolumeClaim", {}).get("claimName") == c["metadata"]["name"]
                        for v in p.get("spec", {}).get("volumes", []))]
        if held and "--wait=true" in argv:
            sys.stderr.write(f"error: timed out waiting for the condition on persistentvolumeclaims/"
                             f"{claims[0]['metadata']['name']} (held by pod {', '.join(held)})\n")
            sys.exit(1)
        if any(c.get("spec", {}).get("storageClassName") == "fsx-sc" for c in claims):
            fsx = client("fsx", os.environ.get("AWS_REGION", "us-west-2"))
            for fs in fsx.describe_file_systems()["FileSystems"]:
                if any(t["Key"] == "doeks/cluster" for t in fs.get("Tags", [])):
                    fsx.delete_file_system(FileSystemId=fs["FileSystemId"])


eksctl() if tool == "eksctl" else kube()
