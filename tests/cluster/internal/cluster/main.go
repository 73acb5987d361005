package cluster

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Root is the folder tests/cluster (two above this one).
func Root() string {
	_, file, _, _ := goruntime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// Main runs a test package's tests (TestMain's m) against one cluster of its own, started with
// opts in a temporary folder named after pkg: the binaries come from $DEVHOST_CLUSTER_BIN, else
// from tests/cluster/build. ready gets the cluster, or nil and the reason every scenario skips
// with when it cannot start on this machine (the package's other tests still run; with
// CI=true the package fails instead). On failure
// the components' log tails are printed, and with $DEVHOST_CLUSTER_KEEP the folder is kept.
// Returns the exit code for os.Exit.
func Main(m *testing.M, pkg string, opts Options, ready func(c *Cluster, skipReason string)) int {
	bin := os.Getenv("DEVHOST_CLUSTER_BIN")
	if bin == "" {
		build := filepath.Join(Root(), "build")
		out, err := exec.Command(build).Output()
		if err != nil {
			fmt.Fprintf(os.Stderr, "tests/cluster/build: %v\n", err)
			return 1
		}
		bin = strings.TrimSpace(string(out))
	}
	dir, err := os.MkdirTemp("", "devhost-cluster-"+pkg+"-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	start := time.Now()
	c, err := StartWith(bin, dir, opts)
	if err != nil {
		fmt.Fprintf(os.Stderr, "the one-node cluster could not start on this machine: %v\n", err)
		// CI installs and builds everything the cluster needs: there, not starting is a failure,
		// never a reason for every scenario to skip.
		if os.Getenv("CI") == "true" {
			return 1
		}
		first, _, _ := strings.Cut(err.Error(), "\n")
		ready(nil, "the one-node cluster could not start on this machine: "+first)
		return m.Run()
	}
	defer c.Stop()
	runtime := "fakecri"
	if opts.Containerd {
		runtime = "containerd, runc"
	}
	components := "etcd, kube-apiserver, " + runtime + ", kubelet"
	if opts.ControlPlane {
		components = "etcd, kube-apiserver, kube-scheduler, kube-controller-manager, " + runtime + ", kubelet"
	}
	if opts.RBAC {
		components += "; Node,RBAC"
	}
	fmt.Printf("one-node cluster (%s) Ready in %v\n", components, time.Since(start).Round(time.Millisecond))
	// Which versions met: the version-skew runs start an older kubelet ($DEVHOST_KUBELET_BIN).
	if v, err := c.Client.Discovery().ServerVersion(); err == nil {
		if n, err := c.Client.CoreV1().Nodes().Get(context.Background(), NodeName, metav1.GetOptions{}); err == nil {
			fmt.Printf("kube-apiserver %s, kubelet %s\n", v.GitVersion, n.Status.NodeInfo.KubeletVersion)
		}
	}
	// Pods need their service account to exist (no serviceaccount controller runs).
	if _, err := c.Client.CoreV1().ServiceAccounts("default").Create(context.Background(),
		&v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ready(c, "")
	code := m.Run()
	if code != 0 {
		fmt.Println(c.Logs(40))
		if os.Getenv("DEVHOST_CLUSTER_KEEP") != "" {
			keep, _ := os.MkdirTemp("", "devhost-cluster-logs-")
			_ = exec.Command("cp", "-a", dir+"/.", keep).Run()
			fmt.Println("cluster folder kept in", keep)
		}
	}
	return code
}
