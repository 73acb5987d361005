package containers_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/devhost"
)

// TestSimulatedRebootRestartsThePodWithItsDeviceThroughCDI: a pod (restart policy Always) holds
// an example.com/accel device handed out by CDI name (device_list_strategy = "cdi", specs in
// /var/run/cdi). The node loses power: devhost, the kubelet, containerd and every container are
// killed, and the tmpfs go (/var/run/cdi, containerd's and runc's state); the disk stays
// (images, the kubelet's folder with its device checkpoint, devhost's state). containerd and
// devhost start again, then the kubelet: devhost has written its specs again before the kubelet
// runs the pod, the pod's container starts again with the same device (its node, openable), and
// no container creation failed on the way.
func TestSimulatedRebootRestartsThePodWithItsDeviceThroughCDI(t *testing.T) {
	needCluster(t)
	clearCDI(t)
	nodes := "/var/lib/devhost-test-nodes"
	makeExampleNodes(t, nodes)
	n := startDevhost(t, devhost.Options{CDIDir: "/var/run/cdi", ExampleDevDir: nodes})
	always := func(p *v1.Pod) { p.Spec.RestartPolicy = v1.RestartPolicyAlways }
	pod := scriptPod(t, "rebooted", probeDevices+"\necho done\ntrap 'exit 0' TERM\nwhile :; do sleep 1; done\n",
		map[string]int64{"example.com/accel": 1}, always)
	before := strings.Join(containerOutput(t, pod, 90*time.Second), "\n")
	ids := heldIDs(t, pod.Name)
	if len(ids) != 1 {
		t.Fatalf("PodResources: the pod holds %v", ids)
	}
	i := exampleIndex(t, ids[0])
	node := fmt.Sprintf("node /dev/example%d character special file %x:%x", i, exampleNodes[i].major, exampleNodes[i].minor)
	if !strings.Contains(before, node) {
		t.Fatalf("before the reboot the container lacks %q:\n%s", node, before)
	}

	n.dh.Kill(t)
	if err := cl.PowerOff(); err != nil {
		t.Fatal(err)
	}
	if left, _ := filepath.Glob("/var/run/cdi/*"); len(left) != 0 {
		t.Fatalf("/var/run/cdi not emptied by the power-off: %v", left)
	}
	off := time.Now()
	if err := cl.PowerOnRuntime(); err != nil {
		t.Fatal(err)
	}
	n.dh = devhost.Start(t, n.config)
	devhost.Eventually(t, 30*time.Second, "devhost's CDI specs back in /var/run/cdi", func() string {
		if _, err := os.Stat("/var/run/cdi/devhost-example.com_accel.json"); err != nil {
			return err.Error()
		}
		return ""
	})
	specsBack := time.Since(off)
	if err := cl.StartKubelet(); err != nil {
		t.Fatal(err)
	}
	waitNodeShows(t, n.list)
	after := strings.Join(attemptOutput(t, pod, 1, 120*time.Second), "\n")
	t.Logf("power on → devhost's specs back after %v, the pod's container running again after %v",
		specsBack.Round(time.Millisecond), time.Since(off).Round(time.Millisecond))
	for _, w := range []string{node, fmt.Sprintf("open /dev/example%d ok", i)} {
		if !strings.Contains(after, w) {
			t.Errorf("after the reboot the container lacks %q:\n%s", w, after)
		}
	}
	if got := heldIDs(t, pod.Name); strings.Join(got, ",") != ids[0] {
		t.Errorf("after the reboot the pod holds %v, before %v", got, ids)
	}
	events, err := cl.Client.CoreV1().Events("default").List(context.Background(),
		metav1.ListOptions{FieldSelector: "involvedObject.name=" + pod.Name})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range events.Items {
		if e.Type == v1.EventTypeWarning {
			t.Errorf("the pod's events after the reboot: %s %s: %s", e.Type, e.Reason, e.Message)
		}
	}
}
