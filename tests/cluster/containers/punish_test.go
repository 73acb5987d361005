package containers_test

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

// What the runtime punishes: containerd drops a CDI name that two spec files of one folder
// define, and fails every container given it with CreateContainerError. devhost watches the
// runtime's CDI folders, so it says so (an ERROR naming the other file, and its gauge) when the
// other file is written, and writes its own spec again when someone deletes it.

const (
	runCDI      = "/var/run/cdi"
	accelSpec   = runCDI + "/devhost-example.com_accel.json"
	accelGauge  = `devhost_cdi_unresolvable_devices{resource="example.com/accel"}`
	testDevNode = "/var/lib/devhost-test-nodes"
)

// freeAddr is a loopback address with a port free now, for metrics_addr.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// waitGauge waits until devhost's /metrics at addr says the gauge of example.com/accel is want.
func waitGauge(t *testing.T, addr string, want int) {
	t.Helper()
	line := fmt.Sprintf("%s %d", accelGauge, want)
	devhost.Eventually(t, 10*time.Second, line, func() string {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		for _, l := range strings.Split(string(body), "\n") {
			if l == line {
				return ""
			}
			if strings.HasPrefix(l, accelGauge+" ") {
				return "the scrape says " + l
			}
		}
		return "no " + accelGauge + " in the scrape"
	})
}

// waitLogLine waits until devhost's log has a line holding every one of parts, and returns it.
func waitLogLine(t *testing.T, n *node, parts ...string) string {
	t.Helper()
	var found string
	devhost.Eventually(t, 10*time.Second, fmt.Sprintf("devhost logs a line with %q", parts), func() string {
		data, _ := os.ReadFile(n.dh.Log)
		for _, l := range strings.Split(string(data), "\n") {
			all := true
			for _, p := range parts {
				all = all && strings.Contains(l, p)
			}
			if all {
				found = l
				return ""
			}
		}
		return "not yet"
	})
	return found
}

// TestARuntimeDroppedCDINameIsSaidByDevhostAndThePodStartsOnceItResolves: with
// device_list_strategy = "cdi" and cdi_dir = /var/run/cdi, a second vendor's spec in that folder
// defining example.com/accel=example-0 makes containerd drop the name. devhost logs an ERROR
// naming the other file and its gauge says 1 as soon as the file is written; a pod given
// example-0 (the only healthy device) then fails with CreateContainerError, "unresolvable CDI
// devices". Once the file is removed the gauge is 0 and the kubelet's next try starts the pod,
// whose container has the device's node.
func TestARuntimeDroppedCDINameIsSaidByDevhostAndThePodStartsOnceItResolves(t *testing.T) {
	needCluster(t)
	clearCDI(t)
	makeExampleNodes(t, testDevNode)
	other := filepath.Join(runCDI, "other-vendor.json")
	_ = os.Remove(other)
	t.Cleanup(func() { _ = os.Remove(other) })
	addr := freeAddr(t)
	n := startDevhost(t, devhost.Options{CDIDir: runCDI, MetricsAddr: addr, ExampleDevDir: testDevNode})
	// Only example-0 healthy: the kubelet can give the pod no other device.
	health := filepath.Join(filepath.Dir(n.config), "health")
	if err := os.WriteFile(health, []byte("example-1\nexample-2\nexample-3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	waitAllocatable(t, "example.com/accel", 1)
	waitGauge(t, addr, 0)

	spec := `{"cdiVersion":"0.5.0","kind":"example.com/accel","devices":[{"name":"example-0","containerEdits":{"env":["OTHER_VENDOR=1"]}}]}`
	if err := os.WriteFile(other, []byte(spec), 0o644); err != nil {
		t.Fatal(err)
	}
	said := time.Now()
	line := waitLogLine(t, n, "ERROR", "CDI name example.com/accel=example-0", "is defined twice", other, accelSpec)
	t.Logf("devhost, %v after the other vendor's file was written: %s", time.Since(said).Round(time.Millisecond), line)
	waitGauge(t, addr, 1)

	pod := shellPod(t, "punished", probeDevices, map[string]int64{"example.com/accel": 1})
	var why string
	devhost.Eventually(t, 90*time.Second, "the pod fails with CreateContainerError", func() string {
		why = waitingReasons(getPod(t, pod.Name))
		if strings.Contains(why, "CreateContainerError") {
			return ""
		}
		return "waiting: " + why
	})
	for _, part := range []string{"unresolvable CDI devices", "example.com/accel=example-0"} {
		if !strings.Contains(why, part) {
			t.Errorf("the pod's CreateContainerError lacks %q: %s", part, why)
		}
	}
	t.Logf("the runtime, as devhost had said: %s", why)
	if c := strings.Count(readLog(t, n), "is defined twice"); c != 1 {
		t.Errorf("devhost said the conflict %d times, want once (until it changes)", c)
	}

	if err := os.Remove(other); err != nil {
		t.Fatal(err)
	}
	removed := time.Now()
	waitGauge(t, addr, 0)
	waitLogLine(t, n, "every CDI name of the resource resolves again", "example.com/accel")
	out := strings.Join(containerOutput(t, pod, 120*time.Second), "\n")
	t.Logf("the container's report %v after the other vendor's file was removed", time.Since(removed).Round(time.Millisecond))
	n0 := exampleNodes[0]
	for _, want := range []string{
		fmt.Sprintf("node /dev/example0 character special file %x:%x", n0.major, n0.minor),
		"open /dev/example0 ok",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the container, started once the name resolved, lacks %q:\n%s", want, out)
		}
	}
}

// TestDevhostWritesItsDeletedCDISpecAgainAndAPodThroughCDIStarts: devhost's own spec in
// /var/run/cdi deleted by hand is written again at once (byte for byte, said in its log), and a
// pod started after asks for a device through CDI, starts, and has the device's node.
func TestDevhostWritesItsDeletedCDISpecAgainAndAPodThroughCDIStarts(t *testing.T) {
	needCluster(t)
	clearCDI(t)
	makeExampleNodes(t, testDevNode)
	n := startDevhost(t, devhost.Options{CDIDir: runCDI, ExampleDevDir: testDevNode})
	want, err := os.ReadFile(accelSpec)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(accelSpec); err != nil {
		t.Fatal(err)
	}
	took := devhost.Eventually(t, 5*time.Second, accelSpec+" written again", func() string {
		got, err := os.ReadFile(accelSpec)
		if err != nil {
			return err.Error()
		}
		if !bytes.Equal(got, want) {
			return "different content"
		}
		return ""
	})
	line := waitLogLine(t, n, "CDI spec "+accelSpec+" was removed by someone else; written again")
	t.Logf("written again %v after the deletion: %s", took.Round(time.Millisecond), line)

	pod := shellPod(t, "after-repair", probeDevices, map[string]int64{"example.com/accel": 1})
	out := strings.Join(containerOutput(t, pod, 90*time.Second), "\n")
	devs, err := cluster.PodDevices("default", pod.Name)
	if err != nil {
		t.Fatal(err)
	}
	ids := devs["example.com/accel"]
	if len(ids) != 1 {
		t.Fatalf("PodResources shows %v, want one example.com/accel device", devs)
	}
	var i int
	if _, err := fmt.Sscanf(ids[0], "example-%d", &i); err != nil || i >= len(exampleNodes) {
		t.Fatalf("unexpected device ID %q", ids[0])
	}
	node := fmt.Sprintf("node /dev/example%d character special file %x:%x", i, exampleNodes[i].major, exampleNodes[i].minor)
	if !strings.Contains(out, node) {
		t.Errorf("the container lacks %q:\n%s", node, out)
	}
}

// waitAllocatable waits until the Node's allocatable of resource is want.
func waitAllocatable(t *testing.T, resource string, want int64) {
	t.Helper()
	devhost.Eventually(t, 60*time.Second, fmt.Sprintf("the Node's allocatable %s is %d", resource, want), func() string {
		nd, err := cl.Node()
		if err != nil {
			return err.Error()
		}
		q := nd.Status.Allocatable[v1.ResourceName(resource)]
		if q.Value() != want {
			return fmt.Sprintf("allocatable %d", q.Value())
		}
		return ""
	})
}

func readLog(t *testing.T, n *node) string {
	t.Helper()
	data, err := os.ReadFile(n.dh.Log)
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}
