// doeks' build of etcd for its local cluster's API server: upstream's server entry point, nothing added.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
