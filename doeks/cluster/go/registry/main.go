// doeks' build of the container registry for the EKS rehearsal (doeks/rehearsal/registry.py): upstream's
// `distribution` server with only the filesystem storage driver (no cloud storage back ends, no auth, no proxy
// cache). It listens on loopback only; the node's containerd pulls from it through its registry host config, under
// the ECR names the EKS manifests use.
package main

import (
	"github.com/distribution/distribution/v3/registry"

	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
)

func main() {
	// nolint:errcheck
	registry.RootCmd.Execute()
}
