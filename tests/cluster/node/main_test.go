// One-node Kubernetes scenarios: devhost on config/demo.toml served to a real kubelet
// (k8s.io/kubernetes, the version pinned in tests/cluster/go.mod) that registers a real Node
// with a real kube-apiserver and etcd, and runs pods on the kubelet's fake CRI runtime.
package node_test

import (
	"os"
	"testing"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/nodens"
)

var (
	cl         *cluster.Cluster
	skipReason string
)

func TestMain(m *testing.M) {
	nodens.Enter()
	os.Exit(cluster.Main(m, "node", cluster.Options{}, func(c *cluster.Cluster, skip string) { cl, skipReason = c, skip }))
}

func needCluster(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}
