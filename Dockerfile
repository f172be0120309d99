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
    else echo "DOWNLOADS=false: aws cli, eksctl, kubectl, helm and kubectx are not installed in this image"; fi

# doeks itself with its cloud extras (kubernetes, docker, sagemaker, kfp, bcrypt: imported by eks/csi/kubeflow tasks)
# and matplotlib (gpu-metrics.show, efa.report, elasticjob.plot draw PNGs; torch stays out of this image),
# in a virtual environment (the context is filtered by .dockerignore). .build/ holds what
# `invoke build` adds at build time only (e.g. a CA bundle for pip behind a TLS-inspecting proxy); it is git-ignored,
# never committed, and removed from the image in the same layer.
COPY . /opt/src/doeks
RUN set -eu; cd /opt/src/doeks; \
    if [ -s .build/ca.crt ]; then export PIP_CERT=/opt/src/doeks/.build/ca.crt; fi; \
    python3 -m venv /opt/doeks && pip install -q --no-cache-dir ".[cloud]" "matplotlib>=3.8" && rm -rf .build; \
    install -m 0755 docker/selftest /usr/local/bin/doeks-selftest; mkdir -p /doeks
WORKDIR /doeks
CMD ["bash"]
