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
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
	"devhost.test/cluster/internal/nodens"
)

var (
	cl         *cluster.Cluster
	skipReason string
)

func TestMain(m *testing.M) {
	nodens.Enter()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	bin := os.Getenv("DEVHOST_CLUSTER_BIN")
	if bin == "" {
		out, err := exec.Command(filepath.Join(devhost.Root(), "tests", "cluster", "build")).Output()
		if err != nil {
			fmt.Fprintf(os.Stderr, "tests/cluster/build: %v\n", err)
			return 1
		}
		bin = strings.TrimSpace(string(out))
	}
	dir, err := os.MkdirTemp("", "devhost-cluster-dra-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	start := time.Now()
	cl, err = cluster.StartWith(bin, dir, cluster.Options{ControlPlane: true, RBAC: true})
	if err != nil {
		first, _, _ := strings.Cut(err.Error(), "\n")
		skipReason = "the one-node cluster could not start on this machine: " + first
		fmt.Fprintf(os.Stderr, "the one-node cluster could not start on this machine: %v\n", err)
		return m.Run()
	}
	fmt.Printf("one-node cluster (etcd, kube-apiserver, kube-scheduler, kube-controller-manager, fakecri, kubelet; Node,RBAC) Ready in %v\n",
		time.Since(start).Round(time.Millisecond))
	defer cl.Stop()
	// Pods need their service account to exist (no serviceaccount controller runs).
	ctx := context.Background()
	if _, err := cl.Client.CoreV1().ServiceAccounts("default").Create(ctx,
		&v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	code := m.Run()
	if code != 0 {
		fmt.Println(cl.Logs(40))
		if os.Getenv("DEVHOST_CLUSTER_KEEP") != "" {
			keep, _ := os.MkdirTemp("", "devhost-cluster-logs-")
			_ = exec.Command("cp", "-a", dir+"/.", keep).Run()
			fmt.Println("cluster folder kept in", keep)
		}
	}
	return code
}

func needCluster(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}
