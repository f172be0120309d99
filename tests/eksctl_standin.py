#!/usr/bin/env python3
"""A recorded-argv stand-in for eksctl (which cannot run here): appends its argv to $EKSCTL_RECORD and performs the
effect on the local AWS-API endpoint (moto) with boto3, so doeks' boto3 read-back sees what eksctl would have made."""
import json
import os
import sys

import boto3
import yaml

argv = sys.argv[1:]
with open(os.environ["EKSCTL_RECORD"], "a") as record:
    record.write(json.dumps(argv) + "\n")


def flag(name):
    return argv[argv.index(name) + 1]


def eks(region):
    return boto3.client("eks", region_name=region, endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                        aws_access_key_id="testing", aws_secret_access_key="testing")


if argv[:2] == ["create", "cluster"]:
    config = yaml.safe_load(open(flag("-f")))
    meta = config["metadata"]
    client = eks(meta["region"])
    client.create_cluster(name=meta["name"], version=meta["version"], roleArn="arn:aws:iam::123456789012:role/eks",
                          resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    for group in config["managedNodeGroups"]:
        client.create_nodegroup(clusterName=meta["name"], nodegroupName=group["name"], instanceTypes=[group["instanceType"]],
                                scalingConfig={"minSize": group["minSize"], "desiredSize": group["desiredCapacity"],
                                               "maxSize": group["maxSize"]}, subnets=["subnet-1"],
                                nodeRole="arn:aws:iam::123456789012:role/node", labels=group.get("labels", {}))
elif argv[:2] == ["delete", "cluster"]:
    client = eks(flag("--region"))
    name = flag("--name")
    for group in client.list_nodegroups(clusterName=name)["nodegroups"]:
        client.delete_nodegroup(clusterName=name, nodegroupName=group)
    client.delete_cluster(name=name)
elif argv[:2] == ["scale", "nodegroup"]:
    client = eks(flag("--region"))
    client.update_nodegroup_config(clusterName=flag("--cluster"), nodegroupName=flag("--name"),
                                   scalingConfig={"desiredSize": int(flag("--nodes"))})
sys.exit(0)
