// Dynamic Resource Allocation on a one-node Kubernetes: devhost serves `api = "dra"`
// resources to the real kubelet (its DRA plugin manager and plugin watcher), publishes
// ResourceSlices through the real API server, and the real kube-scheduler and
// kube-controller-manager turn claims into allocations. The API server authorizes with
// Node,RBAC: devhost's token is the ServiceAccount kube-system/devhost, whose rights are only
// those of the RBAC objects in deploy/dra/, so the tests prove those objects suffice.
//
// today_test.go checks the control plane and devhost's identity, registration_test.go the
// kubelet's registration of devhost's drivers, and scenarios_test.go the scenarios of issue
// #19: slices, claims scheduled, prepared, started and unprepared, restarts.
package dra_test

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
	os.Exit(cluster.Main(m, "dra", cluster.Options{ControlPlane: true, RBAC: true}, func(c *cluster.Cluster, skip string) { cl, skipReason = c, skip }))
}

func needCluster(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}
