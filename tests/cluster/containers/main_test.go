// Real containers: devhost serves a real kubelet whose pods run on a real container runtime
// (containerd 2.x and runc, built by tests/cluster/build-runtime), and every scenario asserts
// what a container actually sees, from inside it: its device nodes, what its device cgroup lets
// it open, its env and mounts. The API server authorizes with Node,RBAC, as in dra/: the
// kubelet is system:node:devhost-node, and a devhost serving DRA resources has only the rights
// of deploy/dra's RBAC objects (its token is the ServiceAccount kube-system/devhost's).
package containers_test

import (
	"os"
	"path/filepath"
	"testing"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
	"devhost.test/cluster/internal/nodens"
)

var (
	cl         *cluster.Cluster
	skipReason string
)

func TestMain(m *testing.M) {
	nodens.EnterNode(filepath.Join(devhost.Root(), "config", "sim"))
	os.Exit(cluster.Main(m, "containers", cluster.Options{Containerd: true, ControlPlane: true, RBAC: true}, func(c *cluster.Cluster, skip string) { cl, skipReason = c, skip }))
}

func needCluster(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}
