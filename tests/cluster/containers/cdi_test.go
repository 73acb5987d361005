package containers_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

// probeAll prints every character device under /dev with its major:minor, the environment,
// and every mount point of the container.
const probeAll = `find /dev -type c | while read -r d; do echo "node $d $(stat -c '%t:%T' "$d")"; done
env | while read -r e; do echo "env $e"; done
while read -r _ _ _ _ m _; do echo "mount $m"; done < /proc/self/mountinfo`

// TestEveryDemoResourceThroughCDIReachesTheContainer: with device_list_strategy = "cdi" on every
// resource of the demo node and cdi_dir = /var/run/cdi (where containerd reads specs), a pod per
// resource asking for one device starts: containerd resolved devhost's CDI names from the
// specs devhost wrote, and inside each container are the device nodes (with the host nodes'
// major:minor), the env and the mounts that those names stand for, resolved independently by the
// reference CDI library, and the env the answer carries beside the names.
func TestEveryDemoResourceThroughCDIReachesTheContainer(t *testing.T) {
	throughCDI(t, devhost.Options{CDIDir: "/var/run/cdi"}, func(string) bool { return true })
}

// TestNvidiaDriversOwnCDIStrategyStartsPodsOnContainerd: with the NVIDIA driver's own
// device_list_strategy = "cdi" (what NVIDIA recommends), devhost answers Allocate with the
// driver's CDI names and defines them in its specs in /var/run/cdi: pods asking for a GPU and for
// a MIG device start on containerd (before, every such pod failed with CreateContainerError:
// `unresolvable CDI devices nvidia.com/gpu=GPU-…`), and each container has what the names stand for.
func TestNvidiaDriversOwnCDIStrategyStartsPodsOnContainerd(t *testing.T) {
	throughCDI(t, devhost.Options{CDIDir: "/var/run/cdi", NvidiaCDI: true},
		func(res string) bool { return strings.HasPrefix(res, "nvidia.com/") })
}

// clearCDI removes the spec files an earlier test's devhost left in the runtime's folders (a
// stopping devhost keeps its specs, for containers that restart during an upgrade).
func clearCDI(t *testing.T) {
	for _, dir := range cluster.CDIDirs {
		files, _ := filepath.Glob(filepath.Join(dir, "devhost-*"))
		for _, f := range files {
			if err := os.Remove(f); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// throughCDI starts devhost with opts and, for each resource that only selects, a pod asking
// for one device, and checks each container against the CDI names devhost answers for it.
func throughCDI(t *testing.T, opts devhost.Options, only func(resource string) bool) {
	needCluster(t)
	clearCDI(t)
	all := startDevhost(t, opts).list
	var list []devhost.Resource
	for _, r := range all {
		if only(r.Resource) {
			list = append(list, r)
		}
	}
	pods := map[string]string{} // resource -> pod
	for _, r := range list {
		name := "cdi-" + strings.NewReplacer("/", "-", ".", "-").Replace(r.Resource)
		pods[r.Resource] = name
		shellPod(t, name, probeAll, map[string]int64{r.Resource: 1})
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(cluster.CDIDirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatalf("the reference CDI library on %v: %v", cluster.CDIDirs, err)
	}
	for path, errs := range cache.GetErrors() {
		t.Errorf("CDI: %s: %v", path, errs)
	}
	for _, r := range list {
		pod := getPod(t, pods[r.Resource])
		lines := containerOutput(t, pod, 90*time.Second)
		devs, err := cluster.PodDevices("default", pod.Name)
		if err != nil {
			t.Fatal(err)
		}
		ids := devs[r.Resource]
		if len(ids) != 1 {
			t.Fatalf("%s: PodResources shows %v, want one %s device", pod.Name, devs, r.Resource)
		}
		// The CDI names devhost answers for this device (the same answer the kubelet got).
		resp, err := devhost.Plugin(t, pluginDir, r.Resource).Allocate(devhost.Ctx(t),
			&pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
		if err != nil {
			t.Fatalf("%s: Allocate(%v): %v", r.Resource, ids, err)
		}
		var names []string
		for _, d := range resp.ContainerResponses[0].CdiDevices {
			names = append(names, d.Name)
		}
		if len(names) == 0 {
			t.Fatalf("%s: Allocate returned no CDI name with device_list_strategy = \"cdi\"", r.Resource)
		}
		want := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
		if unresolved, err := cache.InjectDevices(want, names...); err != nil {
			t.Fatalf("%s: the reference library cannot resolve %v: %v (unresolved %v)", r.Resource, names, err, unresolved)
		}
		got := "\n" + strings.Join(lines, "\n") + "\n"
		var checked []string
		for _, d := range want.Linux.Devices {
			checked = append(checked, fmt.Sprintf("node %s %x:%x", d.Path, d.Major, d.Minor))
		}
		for _, e := range want.Process.Env {
			checked = append(checked, "env "+e)
		}
		// What the answer carries besides the names (the allocate hook's env) reaches it too.
		for k, v := range resp.ContainerResponses[0].Envs {
			checked = append(checked, "env "+k+"="+v)
		}
		for _, m := range want.Mounts {
			checked = append(checked, "mount "+m.Destination)
		}
		for _, c := range checked {
			if !strings.Contains(got, "\n"+c+"\n") {
				t.Errorf("%s (%s, %v): the container lacks %q; it has:%s", r.Resource, pod.Name, names, c, got)
			}
		}
		t.Logf("%s: %v → %d device nodes, %d env (and %d from the answer), %d mounts, all in the container", r.Resource, names,
			len(want.Linux.Devices), len(want.Process.Env), len(resp.ContainerResponses[0].Envs), len(want.Mounts))
	}
}
