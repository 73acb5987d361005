// One-node Kubernetes scenarios: devhost on config/demo.toml served to a real kubelet
// (k8s.io/kubernetes, the version pinned in tests/cluster/go.mod) that registers a real Node
// with a real kube-apiserver and etcd, and runs pods on the kubelet's fake CRI runtime.
package node_test

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
	dir, err := os.MkdirTemp("", "devhost-cluster-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	start := time.Now()
	cl, err = cluster.Start(bin, dir)
	if err != nil {
		// Every scenario skips with this reason; the device-manager tests still run.
		first, _, _ := strings.Cut(err.Error(), "\n")
		skipReason = "the one-node cluster could not start on this machine: " + first
		fmt.Fprintf(os.Stderr, "the one-node cluster could not start on this machine: %v\n", err)
		return m.Run()
	}
	fmt.Printf("one-node cluster (etcd, kube-apiserver, fakecri, kubelet) Ready in %v\n", time.Since(start).Round(time.Millisecond))
	defer cl.Stop()
	// Pods need their service account to exist (no controller manager makes it here).
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
