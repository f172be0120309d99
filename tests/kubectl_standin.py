#!/usr/bin/env python3
"""A scripted kubectl stand-in: answers `kubectl get/logs ...` from $KUBECTL_SCRIPT (JSON: a list of
{"match": [words...], "stdout": "...", "stderr": "...", "rc": N}, first whose words all appear in argv wins; no match
= exit 1 "not scripted") and records every call to $RECORD. It can fail as kubectl fails (rc, stderr)."""
import json
import os
import sys

argv = sys.argv[1:]
stdin = sys.stdin.read() if "-f" in argv and "-" in argv else ""
if os.environ.get("RECORD"):
    with open(os.environ["RECORD"], "a") as record:
        record.write(json.dumps({"tool": "kubectl", "argv": argv, "stdin": stdin}) + "\n")
script = json.load(open(os.environ["KUBECTL_SCRIPT"])) if os.environ.get("KUBECTL_SCRIPT") else []
for entry in script:
    if all(word in argv for word in entry["match"]):
        sys.stdout.write(entry.get("stdout", ""))
        sys.stderr.write(entry.get("stderr", ""))
        sys.exit(entry.get("rc", 0))
sys.stderr.write(f"kubectl stand-in: not scripted: {' '.join(argv)}\n")
sys.exit(1)
