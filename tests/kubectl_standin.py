#!/usr/bin/env python3
"""A scripted kubectl stand-in: answers `kubectl get/logs ...` from $KUBECTL_SCRIPT (JSON: a list of
{"match": [words...], "stdout": "...", "stderr": "...", "rc": N}, first whose words all appear in argv wins; no match
= exit 1 "not scripted") and records every call to $RECORD. It can fail as kubectl fails (rc, stderr).

Why it stays: it plays an EKS cluster for the eks target's own paths (its `aws eks update-kubeconfig` context, its
runs record next to moto's cluster, GPU and EFA node types), which doeks' own cluster cannot be. The same verbs on
TARGET=kubernetes, which the eks target extends, run against the real API server in tests/test_kubernetes_jobs.py:
status, describe, logs, scale, delete and every reason rule from real events and container states."""
import json
import os
import sys

argv = sys.argv[1:]
stdin = sys.stdin.read() if "-f" in argv and "-" in argv else ""
if os.environ.get("RECORD"):
    with open(os.environ["RECORD"], "a") as record:
        record.write(json.dumps({"tool": "kubectl", "argv": argv, "stdin": stdin}) + "\n")
script = json.load(open(os.environ["KUBECTL_SCRIPT"])) if os.environ.get("KUBECTL_SCRIPT") else []
# `kubectl get --raw /api/v1/namespaces/NS/pods?labelSelector=...`: the path's parts count as words ("pods")
words = argv + [part for arg in argv if arg.startswith("/api") for part in arg.split("?")[0].split("/")]
for entry in script:
    if all(word in words for word in entry["match"]):
        sys.stdout.write(entry.get("stdout", ""))
        sys.stderr.write(entry.get("stderr", ""))
        sys.exit(entry.get("rc", 0))
sys.stderr.write(f"kubectl stand-in: not scripted: {' '.join(argv)}\n")
sys.exit(1)
