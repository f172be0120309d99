"""doeks' own single-node Kubernetes, for TARGET=kubernetes when no cluster is configured (KUBECONFIG empty).

    build.build(runner)       # once per version: Kubernetes, etcd, CoreDNS from the Go module proxy (setup --kubernetes)
    lifecycle.up(runner)      # guard, bridge, containerd, etcd, control plane, kubelet, kube-proxy, CoreDNS -> kubeconfig
    lifecycle.down(runner)    # all stopped and removed: no process, mount, netns, iptables rule, bridge or cgroup left
    operators                 # the training operator built from its module and deployed from its own manifests
    images                    # every image a manifest names, built here and imported into the node by that name

Layers: versions is a leaf; the rest import doeks' base modules (ui, errors, runner, container) and never the targets
or the units. Import the submodule you need (this package's __init__ imports nothing).
"""
