package containers_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

// simResources are the demo node's FPGA and TPU resources, one pod each asks for one device.
var simResources = []string{"example.com/fpga-nlb0", "example.com/fpga-nlb3", "example.com/alveo-u250", "google.com/tpu"}

// probeSim prints every character device of major devhost.SimMajor the container has, with
// its path, type and major:minor and what opening it gives; then it makes a node of each of
// nodes itself (/dev/sim-probe<i>) and says what opening that gives: only the device cgroup
// stands between the container and a node it made.
func probeSim(nodes []devhost.SimNode) string {
	var b strings.Builder
	fmt.Fprintf(&b, `find /dev -type c | while read -r d; do
  [ "$(stat -c '%%t' "$d")" = %x ] || continue
  echo "node $d $(stat -c '%%F %%t:%%T' "$d")"
  if err=$( (: > "$d") 2>&1 ); then echo "open $d ok"; else echo "open $d failed: ${err##*: }"; fi
done
`, devhost.SimMajor)
	for i, n := range nodes {
		fmt.Fprintf(&b, `mknod /dev/sim-probe%[1]d c %[2]d %[3]d
if err=$( (: > /dev/sim-probe%[1]d) 2>&1 ); then echo "open probe %[1]d ok"; else echo "open probe %[1]d failed: ${err##*: }"; fi
`, i, n.Major, n.Minor)
	}
	return b.String()
}

// The two answers opening a MakeSimDevfs node can give (see devhost.SimMajor): the device cgroup
// let the open through to the kernel, which found no driver; or the cgroup refused it.
const (
	allowed = "No such device or address"
	refused = "Operation not permitted"
)

// TestFPGAPortsAndTPUChipsReachTheContainerAsRealDeviceNodes: the demo node's FPGA driver (Intel
// DFL ports and an Alveo card) and TPU driver (VFIO, boxes) run on their simulated sysfs trees
// with devfs trees of real character devices (devhost.MakeSimDevfs). A pod per resource asking
// for one device starts on containerd and runc; inside, its container has exactly the device
// nodes devhost's Allocate answer names for the device the kubelet assigned it (PodResources),
// at their container paths, as character devices with the host nodes' major:minor, and its
// device cgroup lets it open exactly those: of the nodes it makes itself for every FPGA and TPU
// node, the others are refused. A pod that asked for nothing has none of the nodes, and its
// cgroup refuses them all.
func TestFPGAPortsAndTPUChipsReachTheContainerAsRealDeviceNodes(t *testing.T) {
	byDriver := devhost.MakeSimDevfs(t, "/var/lib/devhost-test-simdevfs")
	all := append(append([]devhost.SimNode(nil), byDriver["fpga"]...), byDriver["tpu"]...)
	startDevhost(t, devhost.Options{SimDevfs: "/var/lib/devhost-test-simdevfs"})

	pods := map[string]string{}
	for _, r := range simResources {
		pods[r] = "sim-" + strings.NewReplacer("/", "-", ".", "-").Replace(r)
		shellPod(t, pods[r], probeSim(all), map[string]int64{r: 1})
	}
	none := shellPod(t, "sim-none", probeSim(all), nil)

	for _, r := range simResources {
		t.Run(r, func(t *testing.T) {
			pod := getPod(t, pods[r])
			out := containerOutput(t, pod, 90*time.Second)
			t.Logf("%s's container:\n%s", pod.Name, strings.Join(out, "\n"))
			devs, err := cluster.PodDevices("default", pod.Name)
			if err != nil {
				t.Fatal(err)
			}
			ids := devs[r]
			if len(ids) != 1 {
				t.Fatalf("PodResources shows %v for %s, want one %s device", devs, pod.Name, r)
			}
			// The device nodes devhost answers for this device (the answer the kubelet got).
			resp, err := devhost.Plugin(t, pluginDir, r).Allocate(devhost.Ctx(t),
				&pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
			if err != nil {
				t.Fatalf("Allocate(%v): %v", ids, err)
			}
			answered := map[string]string{} // fixture path below /dev -> container path
			for _, d := range resp.ContainerResponses[0].Devices {
				host, ok := strings.CutPrefix(d.HostPath, "/var/lib/devhost-test-simdevfs/")
				_, rel, cut := strings.Cut(host, "/")
				if !ok || !cut {
					t.Fatalf("%s: Allocate(%v) answers host node %s, which is not in the devfs tree devhost was given", r, ids, d.HostPath)
				}
				answered["/dev/"+rel] = d.ContainerPath
			}
			if len(answered) == 0 {
				t.Fatalf("%s: Allocate(%v) answers no device node", r, ids)
			}
			checkSimNodes(t, pod.Name, out, all, answered)
			t.Logf("%s: device %v → nodes %v in the container, every other FPGA and TPU node refused", r, ids, answered)
		})
	}
	t.Run("no request", func(t *testing.T) {
		out := containerOutput(t, none, 90*time.Second)
		checkSimNodes(t, none.Name, out, all, nil)
	})
}

// checkSimNodes: the container's report (probeSim) has each node of answered (fixture path →
// container path) at its container path with its major:minor, opened through its cgroup, and no
// other node of the fixtures' major; its own nodes of all open exactly for the answered ones.
func checkSimNodes(t *testing.T, pod string, out []string, all []devhost.SimNode, answered map[string]string) {
	t.Helper()
	got := "\n" + strings.Join(out, "\n") + "\n"
	for i, n := range all {
		want := refused
		if cpath, ok := answered[n.Path]; ok {
			want = allowed
			for _, w := range []string{
				fmt.Sprintf("node %s character special file %x:%x", cpath, n.Major, n.Minor),
				fmt.Sprintf("open %s failed: %s", cpath, allowed),
			} {
				if !strings.Contains(got, "\n"+w+"\n") {
					t.Errorf("%s: the container lacks %q (devhost answered host node %s → %s)", pod, w, n.Path, cpath)
				}
			}
		}
		if w := fmt.Sprintf("open probe %d failed: %s", i, want); !strings.Contains(got, "\n"+w+"\n") {
			t.Errorf("%s: want %q for its own node %d:%d (%s), answered %v", pod, w, n.Major, n.Minor, n.Path, answered)
		}
	}
	if n := strings.Count(got, "\nnode "); n != len(answered) {
		t.Errorf("%s: the container has %d of the FPGA and TPU nodes at their paths, want exactly the %d devhost answered %v", pod, n,
			len(answered), answered)
	}
}
