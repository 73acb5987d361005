package dra_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

const pluginDir = "/var/lib/kubelet/device-plugins"

// node is one devhost serving DRA resources to the cluster's kubelet.
type node struct {
	dh      *devhost.Process
	opts    devhost.DRAOptions
	config  string
	list    []devhost.Resource
	health  string // the example_c driver's health file
	release string // the example_c driver's release record
}

// startDRA starts devhost on a manifest made from opts, with the kubelet's real folders and
// the test's own health file, release record and CDI folder.
func startDRA(t *testing.T, opts devhost.DRAOptions) *node {
	t.Helper()
	needCluster(t)
	dir := t.TempDir()
	n := &node{}
	n.health, n.release = devhost.TestFiles(t, dir)
	opts.KubeletRootDir, opts.KubeletDir, opts.PodResourcesSocket = cluster.RootDir, pluginDir, cluster.PodResourcesSocket
	opts.HealthFile, opts.ReleaseFile = n.health, n.release
	// devhost serves a DRA resource only with an API client (it publishes slices and reads claims).
	if opts.Kubeconfig == "" {
		opts.Kubeconfig, opts.NodeName = cl.DevhostKubeconfig, cluster.NodeName
	}
	if opts.CDIDir == "" {
		opts.CDIDir = filepath.Join(dir, "cdi")
		if err := os.Mkdir(opts.CDIDir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	n.opts = opts
	n.config = devhost.WriteDRAConfig(t, dir, opts)
	n.list = devhost.List(t, n.config)
	n.dh = devhost.Start(t, n.config)
	return n
}

// restart stops devhost (SIGTERM) and starts it again on the same manifest.
func (n *node) restart(t *testing.T) {
	t.Helper()
	n.dh.Stop(t)
	n.dh = devhost.Start(t, n.config)
}

func (n *node) resource(t *testing.T, name string) devhost.Resource {
	t.Helper()
	for _, r := range n.list {
		if r.Resource == name {
			return r
		}
	}
	t.Fatalf("devhost list has no resource %s", name)
	return devhost.Resource{}
}

// logLines is the lines of this devhost's log (the running process's) with every word.
func (n *node) logLines(words ...string) []string {
	return cluster.LinesWith(n.dh.Log, words...)
}

// logTail is the last lines of this devhost's log.
func (n *node) logTail(lines int) string {
	data, _ := os.ReadFile(n.dh.Log)
	l := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// waitRegistered waits until this devhost has logged the kubelet's acceptance of driver at
// least `times` times, and the kubelet has logged a connection to the driver's plugin socket.
func (n *node) waitRegistered(t *testing.T, driver string, times int, timeout time.Duration) time.Duration {
	t.Helper()
	return devhost.Eventually(t, timeout, "the kubelet registers DRA driver "+driver, func() string {
		got := n.logLines(devhost.DRARegisteredLine, "dra_driver="+driver)
		if len(got) < times {
			return fmt.Sprintf("devhost logged %q for %s %d time(s), want %d; devhost log tail:\n%s\nkubelet log (DRA lines):\n%s",
				devhost.DRARegisteredLine, driver, len(got), times, n.logTail(15), strings.Join(kubeletDRALines(driver), "\n"))
		}
		return ""
	})
}

// kubeletDRALines is what the kubelet logged about driver (its DRA plugin manager and plugin
// watcher lines naming it), the last 20.
func kubeletDRALines(driver string) []string {
	l := cl.KubeletLogLines(driver)
	if len(l) > 20 {
		l = l[len(l)-20:]
	}
	return l
}
