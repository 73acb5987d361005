// Command etcd is etcd's own main, built from the pinned go.etcd.io/etcd/server/v3 module
// (its go.mod carries replace lines, so `go install` of it by version is refused).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
