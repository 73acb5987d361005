package containers_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
	"devhost.test/cluster/internal/draapi"
)

// startDRADevhost runs devhost (as a process on the node) with example.com/accel served
// through DRA only: the C example driver handing out the real device nodes under nodes, CDI
// specs in /var/run/cdi where containerd reads them, its token the ServiceAccount
// kube-system/devhost's (rights: deploy/dra's RBAC, applied here with its DeviceClasses).
// It waits until the kubelet has registered the driver and the node's pool offers all four
// devices. The DeviceClasses are deleted when the test ends (their extendedResourceName
// mappings would change how the scheduler treats a later pod's extended resources).
// The class accel.example.com maps draExtended instead of deploy/dra's example.com/accel:
// the earlier tests served example.com/accel as a device plugin, and the kubelet keeps a
// device-plugin resource it has seen (capacity 0) for its 5-minute grace period after the
// plugin left, during which it fails a container asking for that name with "no devices found
// allocated in local cache" however the scheduler satisfied it (docs/operator-guide.md).
// The devhost log's tail is printed if the test fails.
func startDRADevhost(t *testing.T, nodes string) {
	t.Helper()
	needCluster(t)
	clearCDI(t)
	applied, err := draapi.ApplyDeploy(cl)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, a := range applied {
			if name, ok := strings.CutPrefix(a, "DeviceClass/"); ok {
				name, _, _ = strings.Cut(name, " ")
				_ = cl.Client.ResourceV1().DeviceClasses().Delete(context.Background(), name, metav1.DeleteOptions{})
			}
		}
	})
	mapExtendedResource(t, devhost.AccelDriver, draExtended)
	dir := t.TempDir()
	health, release := devhost.TestFiles(t, dir)
	config := devhost.WriteDRAConfig(t, dir, devhost.DRAOptions{
		KubeletRootDir: cluster.RootDir, KubeletDir: pluginDir, PodResourcesSocket: cluster.PodResourcesSocket,
		Kubeconfig: cl.DevhostKubeconfig, NodeName: cluster.NodeName, CDIDir: "/var/run/cdi",
		HealthFile: health, ReleaseFile: release, Accel: true, ExampleDevDir: nodes,
	})
	start := time.Now()
	dh := devhost.Start(t, config)
	// Pods only once the kubelet has registered the driver: the slices are published before
	// that, and a pod the scheduler places meanwhile fails NodePrepareResources ("DRA driver
	// accel.example.com is not registered") and is retried only after the kubelet's back-off
	// (75 s in one full run).
	devhost.Eventually(t, 60*time.Second, "the kubelet registers DRA driver "+devhost.AccelDriver, func() string {
		if len(cluster.LinesWith(dh.Log, devhost.DRARegisteredLine, "dra_driver="+devhost.AccelDriver)) > 0 {
			return ""
		}
		return "devhost has not logged the kubelet's registration of " + devhost.AccelDriver
	})
	t.Logf("%s registered by the kubelet %v after devhost started", devhost.AccelDriver, time.Since(start).Round(time.Millisecond))
	var want []string
	for i := range exampleNodes {
		want = append(want, devhost.DRADeviceName(fmt.Sprintf("example-%d", i)))
	}
	sort.Strings(want)
	devhost.Eventually(t, 60*time.Second, "the pool of "+devhost.AccelDriver+" offers "+strings.Join(want, ","), func() string {
		p := draapi.ReadPool(t, cl, devhost.AccelDriver)
		if p.Complete && strings.Join(p.Names(), ",") == strings.Join(want, ",") {
			return ""
		}
		return fmt.Sprintf("pool complete=%v offers %v\n%s", p.Complete, p.Names(), draapi.SlicesSummary(cl, devhost.AccelDriver))
	})
	t.Logf("%s: all four devices published %v after devhost started", devhost.AccelDriver, time.Since(start).Round(time.Millisecond))
}

// draExtended is the extended resource name the DRA test maps to devhost's accel class: one
// no device plugin has served on this node (see startDRADevhost).
const draExtended = "example.com/dra-accel"

// mapExtendedResource sets the DeviceClass's extendedResourceName to name.
func mapExtendedResource(t *testing.T, class, name string) {
	t.Helper()
	classes := cl.Client.ResourceV1().DeviceClasses()
	c, err := classes.Get(context.Background(), class, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("DeviceClass %s (deploy/dra): %v", class, err)
	}
	c.Spec.ExtendedResourceName = &name
	if _, err := classes.Update(context.Background(), c, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("DeviceClass %s: setting extendedResourceName %s: %v", class, name, err)
	}
}

// scheduled leaves a pod to the scheduler (no spec.nodeName): only the scheduler allocates
// claims and turns an extended resource into one.
func scheduled(p *v1.Pod) { p.Spec.NodeName = "" }

// withClaim gives a pod's container the claim made from the ResourceClaimTemplate tmpl.
func withClaim(tmpl string) func(*v1.Pod) {
	return func(p *v1.Pod) {
		p.Spec.ResourceClaims = append(p.Spec.ResourceClaims, v1.PodResourceClaim{Name: tmpl, ResourceClaimTemplateName: &tmpl})
		c := &p.Spec.Containers[0]
		c.Resources.Claims = append(c.Resources.Claims, v1.ResourceClaim{Name: tmpl})
	}
}

// probeDRA is what each DRA pod's container reports: its example nodes and whether they open
// (probeDevices), what its device cgroup allows (probeCgroup), and its whole environment.
func probeDRA() string {
	return probeDevices + "\n" + probeCgroup() + "\nenv | while read -r e; do echo \"env $e\"; done"
}

// TestDRAClaimsReachTheContainerOnContainerd: devhost serves example.com/accel through DRA only
// (the C example driver's real device nodes), and three pods go through the real scheduler:
// one whose container uses a claim from a ResourceClaimTemplate (deploy/dra's DeviceClass
// accel.example.com), one asking `example.com/dra-accel: 1` as an extended resource (the
// class's extendedResourceName, renamed by startDRADevhost; the scheduler makes the claim),
// one asking for nothing. On
// containerd and runc, each of the first two has exactly the device node of the device its
// claim was allocated, with the host node's major:minor, may open it, has every node and env
// var of the CDI names the kubelet's PodResources lists for it (resolved by the reference CDI
// library from containerd's folders), and its device cgroup lets it open no other example
// device; the two got different devices; the third has no example node and opens none.
func TestDRAClaimsReachTheContainerOnContainerd(t *testing.T) {
	nodes := "/var/lib/devhost-test-nodes"
	makeExampleNodes(t, nodes)
	startDRADevhost(t, nodes)
	draapi.CreateClaimTemplate(t, cl, "default", "one-accel", resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{
		draapi.Request("accel", devhost.AccelDriver, 1),
	}})
	start := time.Now()
	claimPod := shellPod(t, "dra-claim", probeDRA(), nil, scheduled, withClaim("one-accel"))
	extPod := shellPod(t, "dra-extended", probeDRA(), map[string]int64{draExtended: 1}, scheduled)
	plainPod := shellPod(t, "dra-none", probeDRA(), nil, scheduled)
	outs := map[string][]string{}
	for _, p := range []*v1.Pod{claimPod, extPod, plainPod} {
		outs[p.Name] = containerOutput(t, p, 180*time.Second)
		t.Logf("%s's container (its report %v after the pods' creation):\n%s", p.Name, time.Since(start).Round(time.Millisecond),
			strings.Join(outs[p.Name], "\n"))
	}
	// Where the time went (second resolution): in one full run the reports came 79.5 s after
	// the pods' creation, in a run of this test alone 0.7 s.
	for _, p := range []*v1.Pod{claimPod, extPod, plainPod} {
		t.Logf("%s since the pods' creation:\n%s", p.Name, podTimeline(t, p.Name, start))
	}
	t.Logf("three pods created → every container's report in %v", time.Since(start).Round(time.Millisecond))

	claimDev := t.Run("a claim from a template", func(t *testing.T) {
		claim := podClaimByTemplate(t, getPod(t, claimPod.Name), "one-accel")
		checkClaimedDevice(t, claimPod.Name, claim, outs[claimPod.Name])
	})
	extDev := t.Run("an extended resource through the DeviceClass", func(t *testing.T) {
		p := getPod(t, extPod.Name)
		ext := p.Status.ExtendedResourceClaimStatus
		if ext == nil {
			t.Fatalf("pod %s runs without status.extendedResourceClaimStatus (the scheduler made no claim)", p.Name)
		}
		claim, err := cl.Client.ResourceV1().ResourceClaims("default").Get(context.Background(), ext.ResourceClaimName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if devs, err := cluster.PodDevices("default", p.Name); err != nil || len(devs) != 0 {
			t.Errorf("PodResources shows device-plugin devices %v (%v) for %s: %s is served through DRA only", devs, err, p.Name, draExtended)
		}
		checkClaimedDevice(t, p.Name, claim, outs[extPod.Name])
	})
	if claimDev && extDev {
		a, b := podDRADevice(t, claimPod.Name), podDRADevice(t, extPod.Name)
		if a == b {
			t.Errorf("both pods were given device %s", a)
		}
	}
	t.Run("no claim", func(t *testing.T) {
		checkHoldsOnly(t, outs[plainPod.Name], -1)
	})
}

// podClaimByTemplate is the claim the resourceclaim controller made for the pod's claim of
// that name (pod.status.resourceClaimStatuses).
func podClaimByTemplate(t *testing.T, pod *v1.Pod, name string) *resourcev1.ResourceClaim {
	t.Helper()
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == name && s.ResourceClaimName != nil {
			c, err := cl.Client.ResourceV1().ResourceClaims(pod.Namespace).Get(context.Background(), *s.ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return c
		}
	}
	t.Fatalf("pod %s: no claim for %s in status.resourceClaimStatuses %+v", pod.Name, name, pod.Status.ResourceClaimStatuses)
	return nil
}

// podDRADevice is the one DRA device PodResources lists for the pod ("" if not exactly one).
func podDRADevice(t *testing.T, pod string) string {
	t.Helper()
	devs, err := cluster.PodClaimDevices("default", pod)
	if err != nil || len(devs) != 1 {
		return ""
	}
	return devs[0].Device
}

// checkClaimedDevice: the claim is allocated one example device of devhost's pool; the kubelet's
// PodResources lists exactly that device for the pod, with CDI names; the container has
// every device node and env var those names stand for, and exactly that device's node.
func checkClaimedDevice(t *testing.T, pod string, claim *resourcev1.ResourceClaim, out []string) {
	t.Helper()
	if claim.Status.Allocation == nil || len(claim.Status.Allocation.Devices.Results) != 1 {
		t.Fatalf("claim %s: %s; want one device allocated", claim.Name, draapi.ClaimSummary(claim))
	}
	r := claim.Status.Allocation.Devices.Results[0]
	if r.Driver != devhost.AccelDriver || r.Pool != cluster.NodeName {
		t.Fatalf("claim %s: allocated %s/%s/%s, want a device of driver %s, pool %s", claim.Name, r.Driver, r.Pool, r.Device,
			devhost.AccelDriver, cluster.NodeName)
	}
	index := -1
	for i := range exampleNodes {
		if devhost.DRADeviceName(fmt.Sprintf("example-%d", i)) == r.Device {
			index = i
		}
	}
	if index < 0 {
		t.Fatalf("claim %s: allocated device %q, which is none of example-0..3", claim.Name, r.Device)
	}
	devs, err := cluster.PodClaimDevices("default", pod)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 1 || devs[0].Driver != r.Driver || devs[0].Pool != r.Pool || devs[0].Device != r.Device || len(devs[0].CDIDevices) == 0 {
		t.Fatalf("PodResources lists DRA devices %+v for %s; want exactly the claim's %s/%s/%s with its CDI names", devs, pod,
			r.Driver, r.Pool, r.Device)
	}
	names := devs[0].CDIDevices
	cache, err := cdi.NewCache(cdi.WithSpecDirs(cluster.CDIDirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatalf("the reference CDI library on %v: %v", cluster.CDIDirs, err)
	}
	want := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if unresolved, err := cache.InjectDevices(want, names...); err != nil {
		t.Fatalf("the reference CDI library cannot resolve %v (what devhost's NodePrepareResources answered): %v (unresolved %v)",
			names, err, unresolved)
	}
	got := "\n" + strings.Join(out, "\n") + "\n"
	var checked []string
	for _, d := range want.Linux.Devices {
		checked = append(checked, fmt.Sprintf("node %s character special file %x:%x", d.Path, d.Major, d.Minor))
	}
	for _, e := range want.Process.Env {
		checked = append(checked, "env "+e)
	}
	for _, c := range checked {
		if !strings.Contains(got, "\n"+c+"\n") {
			t.Errorf("%s (CDI %v): the container lacks %q", pod, names, c)
		}
	}
	if len(want.Linux.Devices) == 0 {
		t.Errorf("the CDI names %v stand for no device node", names)
	}
	checkHoldsOnly(t, out, index)
	t.Logf("%s: claim %s → %s (CDI %v: %d device node(s), %d env var(s)), all in the container", pod, claim.Name, r.Device, names,
		len(want.Linux.Devices), len(want.Process.Env))
}

// checkHoldsOnly: the container's report shows exactly the example node of device index (none
// for -1), as a character device with its host node's major:minor that opens, and its device
// cgroup refuses every other example device.
func checkHoldsOnly(t *testing.T, out []string, index int) {
	t.Helper()
	got := strings.Join(out, "\n")
	nodes := 0
	for _, l := range out {
		if strings.HasPrefix(l, "node /dev/example") {
			nodes++
		}
	}
	if want := map[bool]int{true: 0, false: 1}[index < 0]; nodes != want {
		t.Errorf("the container has %d example node(s), want %d", nodes, want)
	}
	for i, n := range exampleNodes {
		lines := []string{fmt.Sprintf("probe %d %x:%x", i, n.major, n.minor)}
		if i == index {
			lines = append(lines,
				fmt.Sprintf("node /dev/example%d character special file %x:%x", i, n.major, n.minor),
				fmt.Sprintf("open /dev/example%d ok", i),
				fmt.Sprintf("open probe %d ok", i))
		} else {
			lines = append(lines, fmt.Sprintf("open probe %d failed: /bin/sh: can't create /dev/probe%d: Operation not permitted", i, i))
		}
		for _, w := range lines {
			if !strings.Contains(got, w) {
				t.Errorf("the container lacks %q (device example-%d; the pod holds %s)", w, i, map[bool]string{true: "none", false: fmt.Sprintf("example-%d", index)}[index < 0])
			}
		}
	}
}
