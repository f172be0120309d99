#!/usr/bin/env python3
"""A recorded-argv stand-in for kubectl/helm: appends {tool, argv, stdin} to $RECORD, exits 0.

Why it stays: the tests that use it (test_csi, test_eks, test_teardown) run the eks target against moto, where the
cluster is an EKS one that only AWS runs (its CSI drivers, add-ons and node groups); they assert what doeks would
apply and in which order. What those manifests do on a real API server is shown on doeks' own cluster (the
kubernetes target's claim, operators and jobs in tests/test_kubernetes_*.py)."""
import json
import os
import sys

stdin = sys.stdin.read() if "-f" in sys.argv and "-" in sys.argv else ""
with open(os.environ["RECORD"], "a") as record:
    record.write(json.dumps({"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "stdin": stdin}) + "\n")
