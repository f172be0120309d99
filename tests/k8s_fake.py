"""A tiny HTTP fake of the Kubernetes API for the few reads doeks makes before touching a cluster; the official
kubernetes client really talks to it over HTTP.

Why it stays (doeks' own cluster runs everything else for real): what it serves is made by components that cannot
run here. test_kubeflow_platform reads the Kubeflow platform's prerequisites (istio, cert-manager, the platform's
own Deployments: dozens of images of the 26.03 release that no registry can deliver here) and test_stage_fsx reads a
claim bound by the FSx CSI driver (a PV whose volume handle is a file system AWS made). Served by a real API server,
these objects would still be the ones this file writes: the fake shows as much and starts in no time."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeCluster:
    def __init__(self):
        self.objects: dict[str, dict] = {}  # path -> JSON body
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                path = self.path.split("?")[0]
                fake.requests.append(path)
                body = fake.objects.get(path)
                status = 200 if body is not None else 404
                if body is None:
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}]}))
        return path

    def storage_classes(self, *items):
        self.objects["/apis/storage.k8s.io/v1/storageclasses"] = {
            "kind": "StorageClassList", "apiVersion": "storage.k8s.io/v1", "metadata": {}, "items": list(items)}

    def close(self):
        self.server.shutdown()


def storage_class(name: str, default: bool) -> dict:
    annotations = {"storageclass.kubernetes.io/is-default-class": "true"} if default else {}
    return {"metadata": {"name": name, "annotations": annotations}, "provisioner": "ebs.csi.aws.com"}
