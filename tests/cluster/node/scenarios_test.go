package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/devhost"
)

func TestNodeCapacityAndAllocatableEqualDevhostList(t *testing.T) {
	n := startDevhost(t)
	out, err := cl.Kubectl("get", "node", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var nodes struct {
		Items []v1.Node `json:"items"`
	}
	if err := json.Unmarshal(out, &nodes); err != nil || len(nodes.Items) != 1 {
		t.Fatalf("kubectl get node -o json: %v (%d nodes)", err, len(nodes.Items))
	}
	st := nodes.Items[0].Status
	for _, r := range n.list {
		c, a := st.Capacity[v1.ResourceName(r.Resource)], st.Allocatable[v1.ResourceName(r.Resource)]
		t.Logf("%-24s capacity %s allocatable %s (devhost: %d healthy, %d unhealthy)", r.Resource, c.String(), a.String(), r.Healthy, r.Unhealthy)
		if c.Value() != int64(r.Healthy+r.Unhealthy) || a.Value() != int64(r.Healthy) {
			t.Errorf("%s: kubectl shows capacity %s allocatable %s", r.Resource, c.String(), a.String())
		}
	}
	t.Logf("kubelet %s, runtime %s", st.NodeInfo.KubeletVersion, st.NodeInfo.ContainerRuntimeVersion)
}

// The pod runs with the devices devhost prefers (as PodResources shows them), and the runtime
// is asked for exactly the env and device nodes devhost's Allocate gives for them.
func TestPodRunsWithDevhostsPreferredDevicesAndAllocateEdits(t *testing.T) {
	n := startDevhost(t)
	want := map[string]int64{"example.com/accel": 2, "nvidia.com/gpu": 1}
	pref := map[string][]string{}
	for res, count := range want {
		pref[res] = preferred(t, n, res, int32(count))
	}
	createPod(t, "accel-and-gpu", want)
	waitPodPhase(t, "accel-and-gpu", v1.PodRunning, 60*time.Second)
	got := podDevices(t, "accel-and-gpu")
	for res := range want {
		if strings.Join(got[res], ",") != strings.Join(pref[res], ",") {
			t.Errorf("%s: PodResources shows %v, devhost prefers %v", res, got[res], pref[res])
		}
	}
	rec := cl.CRIRecord(t, "default", "accel-and-gpu")
	devices := map[string]bool{}
	for _, d := range rec.Devices {
		devices[d] = true
	}
	for res := range want {
		a := allocate(t, res, pref[res])
		for k, v := range a.Envs {
			if sortedList(rec.Env[k]) != sortedList(v) {
				t.Errorf("%s: the runtime got %s=%q, Allocate gives %q", res, k, rec.Env[k], v)
			}
		}
		for _, d := range a.Devices {
			if key := fmt.Sprintf("%s -> %s (%s)", d.HostPath, d.ContainerPath, d.Permissions); !devices[key] {
				t.Errorf("%s: device %s not handed to the runtime (got %v)", res, key, rec.Devices)
			}
		}
	}
	if rec.Env["NVIDIA_VISIBLE_DEVICES"] != pref["nvidia.com/gpu"][0] {
		t.Errorf("NVIDIA_VISIBLE_DEVICES = %q, want %s", rec.Env["NVIDIA_VISIBLE_DEVICES"], pref["nvidia.com/gpu"][0])
	}
}

// With device_list_strategy = "cdi" the kubelet hands the runtime devhost's CDI names in the
// CRI's CDIDevices field (and the cdi.k8s.io annotation), for a CDI-aware runtime to resolve.
func TestCDIStrategyReachesTheRuntimeAsCDIDevices(t *testing.T) {
	n := startDevhostCDI(t, t.TempDir())
	pref := preferred(t, n, "example.com/accel", 2)
	createPod(t, "cdi-accel", map[string]int64{"example.com/accel": 2})
	waitPodPhase(t, "cdi-accel", v1.PodRunning, 60*time.Second)
	rec := cl.CRIRecord(t, "default", "cdi-accel")
	a := allocate(t, "example.com/accel", pref)
	var want []string
	for _, c := range a.CdiDevices {
		want = append(want, c.Name)
	}
	if len(want) != 2 {
		t.Fatalf("Allocate with the cdi strategy gave CDI devices %v for %v", want, pref)
	}
	sort.Strings(want)
	got := append([]string(nil), rec.CDIDevices...)
	sort.Strings(got)
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("the runtime got CDI devices %v, devhost's Allocate gives %v", got, want)
	}
	for k, v := range a.Annotations {
		if sortedList(rec.Annotations[k]) != sortedList(v) {
			t.Errorf("annotation %s: the runtime got %q, Allocate gives %q", k, rec.Annotations[k], v)
		}
	}
	t.Logf("CreateContainer: CDI devices %v, annotations %v", rec.CDIDevices, rec.Annotations)
}

func TestUnhealthyDeviceDropsNodeAllocatableAndHealthyRestoresIt(t *testing.T) {
	n := startDevhost(t)
	const res = "example.com/accel"
	_, a := nodeCounts(t)
	before := a[res]
	if err := os.WriteFile(n.health, []byte("example-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	took := devhost.Eventually(t, 20*time.Second, "the Node's allocatable drops by one", func() string {
		c, a := nodeCounts(t)
		if a[res] != before-1 || c[res] != before {
			return fmt.Sprintf("capacity %d allocatable %d", c[res], a[res])
		}
		return ""
	})
	t.Logf("Unhealthy reached the Node in %v (kubelet nodeStatusUpdateFrequency 1s)", took.Round(time.Millisecond))
	if took > 5*time.Second {
		t.Errorf("Unhealthy took %v to reach the Node", took)
	}
	if err := os.WriteFile(n.health, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	took = devhost.Eventually(t, 20*time.Second, "the Node's allocatable restored", func() string {
		if _, a := nodeCounts(t); a[res] != before {
			return fmt.Sprintf("allocatable %d", a[res])
		}
		return ""
	})
	t.Logf("Healthy again reached the Node in %v", took.Round(time.Millisecond))
}

func TestKubeletKilledAndStartedAgainKeepsThePodsDevices(t *testing.T) {
	n := startDevhost(t)
	createPod(t, "survivor", map[string]int64{"example.com/accel": 1, "google.com/tpu": 2})
	waitPodPhase(t, "survivor", v1.PodRunning, 60*time.Second)
	before := podDevices(t, "survivor")
	cl.Kubelet().Stop(syscall.SIGKILL)
	start := time.Now()
	if err := cl.StartKubelet(); err != nil {
		t.Fatal(err)
	}
	if err := cl.WaitNodeReady(120 * time.Second); err != nil {
		t.Fatal(err)
	}
	ready := time.Since(start)
	// Every resource registered again: the kubelet's device manager has devhost's endpoints back.
	devhost.Eventually(t, 60*time.Second, "devhost registered again with the new kubelet", func() string {
		c, a := nodeCounts(t)
		for _, r := range n.list {
			if c[r.Resource] != int64(len(r.Devices)) || a[r.Resource] != int64(r.Healthy) {
				return fmt.Sprintf("%s: capacity %d allocatable %d", r.Resource, c[r.Resource], a[r.Resource])
			}
		}
		if reg := strings.Count(readFile(t, n.dh.Log), "registered with the kubelet"); reg < 2*len(n.list) {
			return fmt.Sprintf("%d registrations in devhost's log, want %d", reg, 2*len(n.list))
		}
		return ""
	})
	t.Logf("kubelet restart: Node Ready %v, every resource registered again %v after the new kubelet started",
		ready.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	// The new kubelet lists the pod's devices from its checkpoint once it has synced the pod.
	devhost.Eventually(t, 60*time.Second, "PodResources lists the pod's devices again", func() string {
		after := podDevices(t, "survivor")
		for res, ids := range before {
			if strings.Join(after[res], ",") != strings.Join(ids, ",") {
				return fmt.Sprintf("%s: PodResources shows %v, before the restart %v", res, after[res], ids)
			}
		}
		return ""
	})
	t.Logf("PodResources lists the pod's checkpointed devices %v after the new kubelet started", time.Since(start).Round(time.Millisecond))
	if p := getPod(t, "survivor"); p.Status.Phase != v1.PodRunning {
		t.Errorf("pod after kubelet restart: %s %s", p.Status.Phase, p.Status.Message)
	}
}

func readFile(t *testing.T, path string) string {
	data, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(data)
}

// Deleting the pod makes devhost call the driver's release hook for its devices, seen through
// the real kubelet's PodResources API.
func TestDeletedPodsDevicesAreReleasedThroughPodResources(t *testing.T) {
	n := startDevhost(t)
	createPod(t, "short-lived", map[string]int64{"example.com/accel": 2})
	waitPodPhase(t, "short-lived", v1.PodRunning, 60*time.Second)
	ids := podDevices(t, "short-lived")["example.com/accel"]
	if len(ids) != 2 {
		t.Fatalf("PodResources shows %v for the pod", ids)
	}
	start := time.Now()
	deletePod(t, "short-lived")
	gone := time.Since(start)
	devhost.Eventually(t, 30*time.Second, "the release hook ran", func() string {
		got := readFile(t, n.release)
		for _, id := range ids {
			if !strings.Contains(got, id) {
				return fmt.Sprintf("release record %q lacks %s", got, id)
			}
		}
		return ""
	})
	t.Logf("pod gone from the API %v after delete; release hook done %v after delete: %q",
		gone.Round(time.Millisecond), time.Since(start).Round(time.Millisecond), strings.TrimSpace(readFile(t, n.release)))
}

// SIGTERM to the old devhost and a new one started: the Node's capacity never drops; the
// allocatable gap the kubelet reports while no plugin is registered is recorded.
func TestDevhostUpgradeUnderARunningPod(t *testing.T) {
	n := startDevhost(t)
	createPod(t, "upgraded-under", map[string]int64{"nvidia.com/gpu": 1})
	waitPodPhase(t, "upgraded-under", v1.PodRunning, 60*time.Second)
	before := podDevices(t, "upgraded-under")

	type sample struct {
		at   time.Duration
		c, a map[string]int64
	}
	var mu sync.Mutex
	var samples []sample
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	start := time.Now()
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			nd, err := cl.Node()
			if err != nil {
				continue
			}
			s := sample{at: time.Since(start), c: map[string]int64{}, a: map[string]int64{}}
			for k, q := range nd.Status.Capacity {
				s.c[string(k)] = q.Value()
			}
			for k, q := range nd.Status.Allocatable {
				s.a[string(k)] = q.Value()
			}
			mu.Lock()
			samples = append(samples, s)
			mu.Unlock()
		}
	}()
	time.Sleep(1 * time.Second)
	n.dh.Stop(t)
	stopped := time.Since(start)
	n.dh = devhost.Start(t, n.config)
	restarted := time.Since(start)
	waitNodeResources(t, n.list, 60*time.Second)
	time.Sleep(3 * time.Second)
	close(stop)
	wg.Wait()

	gapStart, gapEnd := time.Duration(-1), time.Duration(0)
	for _, s := range samples {
		for _, r := range n.list {
			if s.c[r.Resource] != int64(len(r.Devices)) {
				t.Errorf("%v: the Node's capacity of %s dropped to %d", s.at, r.Resource, s.c[r.Resource])
			}
			if s.a[r.Resource] != int64(r.Healthy) {
				if gapStart < 0 {
					gapStart = s.at
				}
				gapEnd = s.at
			}
		}
	}
	if gapStart < 0 {
		t.Logf("upgrade: old devhost stopped at %v, new one started at %v; the Node never showed a lower allocatable (%d samples every 100 ms)",
			stopped.Round(time.Millisecond), restarted.Round(time.Millisecond), len(samples))
	} else {
		t.Logf("upgrade: old devhost stopped at %v, new one started at %v; the Node showed a lower allocatable from %v to %v (%d samples every 100 ms)",
			stopped.Round(time.Millisecond), restarted.Round(time.Millisecond), gapStart, gapEnd, len(samples))
		if gapEnd-gapStart > 10*time.Second {
			t.Errorf("the registration gap seen by the Node lasted %v", gapEnd-gapStart)
		}
	}
	if after := podDevices(t, "upgraded-under"); strings.Join(after["nvidia.com/gpu"], ",") != strings.Join(before["nvidia.com/gpu"], ",") {
		t.Errorf("PodResources after the upgrade: %v, before %v", after, before)
	}
	if p := getPod(t, "upgraded-under"); p.Status.Phase != v1.PodRunning {
		t.Errorf("pod after the upgrade: %s %s", p.Status.Phase, p.Status.Message)
	}
}

func podEvents(t *testing.T, pod string) []string {
	evs, err := cl.Client.CoreV1().Events("default").List(context.Background(),
		metav1.ListOptions{FieldSelector: "involvedObject.name=" + pod})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range evs.Items {
		out = append(out, e.Reason+": "+e.Message)
	}
	return out
}

// Bound by nodeName there is no scheduler to keep the pod Pending: the kubelet's admission
// refuses it (phase Failed) with its own reason and message, from its device manager.
func TestPodAskingForMoreDevicesThanExistIsRefusedByTheKubelet(t *testing.T) {
	startDevhost(t)
	createPod(t, "greedy", map[string]int64{"example.com/accel": 5})
	p := waitPodPhase(t, "greedy", v1.PodFailed, 60*time.Second)
	t.Logf("kubelet: phase %s, reason %q, message %q", p.Status.Phase, p.Status.Reason, p.Status.Message)
	const msg = "requested number of devices unavailable for example.com/accel. Requested: 5, Available: 4"
	if p.Status.Reason != "UnexpectedAdmissionError" || !strings.Contains(p.Status.Message, msg) {
		t.Errorf("want the kubelet's UnexpectedAdmissionError with %q", msg)
	}
}

func TestTPURequestThatIsNotABoxFailsAdmissionWithDevhostsMessageInEvents(t *testing.T) {
	startDevhost(t)
	createPod(t, "three-chips", map[string]int64{"google.com/tpu": 3})
	p := waitPodPhase(t, "three-chips", v1.PodFailed, 60*time.Second)
	t.Logf("kubelet: phase %s, reason %q, message %q", p.Status.Phase, p.Status.Reason, p.Status.Message)
	const msg = "a 3-chip TPU request is not a box this v6e host can give"
	if !strings.Contains(p.Status.Message, msg) {
		t.Errorf("pod status message lacks devhost's %q", msg)
	}
	var evs []string
	devhost.Eventually(t, 30*time.Second, "an event with devhost's message", func() string {
		evs = podEvents(t, "three-chips")
		for _, e := range evs {
			if strings.Contains(e, msg) {
				return ""
			}
		}
		return fmt.Sprintf("events %q", evs)
	})
	t.Logf("events: %q", evs)
}
