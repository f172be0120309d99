#!/usr/bin/env python3
"""A recorded-argv stand-in for kubectl/helm (no cluster here): appends {tool, argv, stdin} to $RECORD, exits 0."""
import json
import os
import sys

stdin = sys.stdin.read() if "-f" in sys.argv and "-" in sys.argv else ""
with open(os.environ["RECORD"], "a") as record:
    record.write(json.dumps({"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "stdin": stdin}) + "\n")
