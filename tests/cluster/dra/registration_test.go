package dra_test

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"devhost.test/cluster/internal/devhost"
)

// The real kubelet's plugin watcher registers both of devhost's DRA drivers: GetInfo on the
// registration socket, then NotifyRegistrationStatus(registered), whose verdict devhost logs
// (devhost shows it nowhere else: not in /status, not in `devhost list`).
//
// The plugin watcher dials the registration socket by its bare path, with no
// grpc.WithAuthority("localhost") (k8s.io/kubernetes v1.34.4 to v1.37.2,
// pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go, func dial), so grpc-go
// sends the socket path as :authority, which h2 under tonic refuses unless devhost mends it
// (host/src/fronts/dra/authority.rs); without the mender the kubelet logs `failed to get plugin
// info using RPC GetInfo ... PROTOCOL_ERROR` and this test fails.
func TestKubeletRegistersDevhostsDRADrivers(t *testing.T) {
	n := startDRA(t, devhost.DRAOptions{GPU: true, Accel: true})
	for _, driver := range []string{devhost.GPUDriver, devhost.AccelDriver} {
		took := n.waitRegistered(t, driver, 1, 60*time.Second)
		t.Logf("%s registered %v after devhost started", driver, took.Round(time.Millisecond))
		// Not an error by itself (the kubelet retries), but the first one says what went wrong before.
		if failed := cl.KubeletLogLines("RegisterPlugin error", driver+"-reg.sock"); len(failed) > 0 {
			t.Logf("the kubelet logged %d failed registration attempt(s) of %s so far, the first: %s", len(failed), driver, failed[0])
		}
	}
	t.Logf("kubelet lines: %s", strings.Join(kubeletDRALines(devhost.GPUDriver), "\n"))
}

// A kubelet killed and started again finds devhost's registration socket in place and
// registers the DRA driver anew (devhost logs a second verdict), with no devhost restart.
func TestRestartedKubeletRegistersTheDRADriverAgain(t *testing.T) {
	n := startDRA(t, devhost.DRAOptions{GPU: true})
	n.waitRegistered(t, devhost.GPUDriver, 1, 60*time.Second)
	cl.Kubelet().Stop(syscall.SIGKILL)
	start := time.Now()
	if err := cl.StartKubelet(); err != nil {
		t.Fatal(err)
	}
	took := n.waitRegistered(t, devhost.GPUDriver, 2, 90*time.Second)
	t.Logf("registered again %v after the new kubelet started", took.Round(time.Millisecond))
	if err := cl.WaitNodeReady(120 * time.Second); err != nil {
		t.Fatal(err)
	}
	t.Logf("Node Ready again %v after the new kubelet started", time.Since(start).Round(time.Millisecond))
}
