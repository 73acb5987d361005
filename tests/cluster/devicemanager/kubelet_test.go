// The kubelet's own device manager (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager), run as a
// library in this test binary, is the kubelet that devhost registers with: the real
// registration server on /var/lib/kubelet/device-plugins/kubelet.sock (a tmpfs in a private
// mount namespace), the real endpoint, checkpoint and allocation code, and admission through
// the real topology manager, as the kubelet's container manager wires them.
package devicemanager_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	cadvisorapi "github.com/google/cadvisor/lib/model"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
	"devhost.test/cluster/internal/nodens"
)

// The kubelet's fixed device-plugin folder, private to this test binary (see TestMain).
const pluginDir = "/var/lib/kubelet/device-plugins"

func TestMain(m *testing.M) {
	nodens.Enter(filepath.Join(devhost.Root(), "config", "sim"))
	os.Exit(m.Run())
}

type allReady struct{}

func (allReady) AddSource(string) {}
func (allReady) AllReady() bool   { return true }

// kubelet is the device manager plus the topology manager, with the kubelet's default
// policy ("none", container scope) and this machine's two simulated NUMA nodes.
type kubelet struct {
	dm   *devicemanager.ManagerImpl
	tm   topologymanager.Manager
	mu   sync.Mutex
	pods []*v1.Pod
}

var logger = klog.Background()

func startKubelet(t *testing.T, active ...*v1.Pod) *kubelet {
	t.Helper()
	topo := []cadvisorapi.Node{{Id: 0}, {Id: 1}}
	tm, err := topologymanager.NewManager(logger, topo, "none", "container", nil)
	if err != nil {
		t.Fatal(err)
	}
	dm, err := devicemanager.NewManagerImpl(logger, topo, tm)
	if err != nil {
		t.Fatal(err)
	}
	tm.AddHintProvider(logger, dm)
	k := &kubelet{dm: dm, tm: tm, pods: active}
	if err := dm.Start(logger, k.activePods, allReady{}, containermap.NewContainerMap(), sets.New[string]()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.stop)
	return k
}

func (k *kubelet) stop() { _ = k.dm.Stop(logger) }

func (k *kubelet) activePods() []*v1.Pod {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]*v1.Pod(nil), k.pods...)
}

// admit runs the kubelet's admission for the pod's devices: the topology manager's Admit,
// which calls the device manager's Allocate per container (GetPreferredAllocation, then
// Allocate on the plugin). The operation is "add", as the kubelet's for a new pod: from 1.37 the
// device manager allocates for nothing else (resize included).
func (k *kubelet) admit(pod *v1.Pod) lifecycle.PodAdmitResult {
	res := k.tm.Admit(context.Background(), &lifecycle.PodAdmitAttributes{Pod: pod, OtherPods: k.activePods(), Operation: lifecycle.AddOperation})
	if res.Admit {
		k.mu.Lock()
		k.pods = append(k.pods, pod)
		k.mu.Unlock()
	}
	return res
}

// capacity returns capacity and allocatable counts per resource, as the Node would show them.
func (k *kubelet) capacity() (map[string]int64, map[string]int64) {
	c, a, _ := k.dm.GetCapacity(logger)
	cm, am := map[string]int64{}, map[string]int64{}
	for n, q := range c {
		cm[string(n)] = q.Value()
	}
	for n, q := range a {
		am[string(n)] = q.Value()
	}
	return cm, am
}

// waitForResources waits until the manager's capacity and allocatable equal what
// `devhost list --json` reports for every resource, and returns how long that took.
func (k *kubelet) waitForResources(t *testing.T, want []devhost.Resource, timeout time.Duration) time.Duration {
	t.Helper()
	return devhost.Eventually(t, timeout, "every resource registered with the kubelet", func() string {
		c, a := k.capacity()
		for _, r := range want {
			if c[r.Resource] != int64(r.Healthy+r.Unhealthy) || a[r.Resource] != int64(r.Healthy) {
				return fmt.Sprintf("%s: capacity %d allocatable %d, devhost lists %d healthy + %d unhealthy",
					r.Resource, c[r.Resource], a[r.Resource], r.Healthy, r.Unhealthy)
			}
		}
		return ""
	})
}

func newPod(name string, limits map[string]int64) *v1.Pod {
	rl := cluster.Limits(limits)
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(name + "-uid")},
		Spec: v1.PodSpec{Containers: []v1.Container{{
			Name: "main", Image: "devhost.test/pause:1",
			Resources: v1.ResourceRequirements{Limits: rl, Requests: rl},
		}}},
	}
}

// node is devhost on config/demo.toml plus the kubelet, both started and settled.
type node struct {
	k       *kubelet
	dh      *devhost.Process
	config  string
	list    []devhost.Resource
	health  string
	tempDir string
}

func startNode(t *testing.T, opts devhost.Options) *node {
	t.Helper()
	dir := t.TempDir()
	opts.KubeletDir = pluginDir
	opts.HealthFile = filepath.Join(dir, "health")
	if err := os.WriteFile(opts.HealthFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := devhost.WriteDemoConfig(t, dir, opts)
	n := &node{config: cfg, list: devhost.List(t, cfg), health: opts.HealthFile, tempDir: dir}
	n.k = startKubelet(t)
	n.dh = devhost.Start(t, cfg)
	took := n.k.waitForResources(t, n.list, 60*time.Second)
	t.Logf("all %d resources registered %v after devhost started", len(n.list), took.Round(time.Millisecond))
	return n
}

func (n *node) resource(t *testing.T, name string) devhost.Resource {
	for _, r := range n.list {
		if r.Resource == name {
			return r
		}
	}
	t.Fatalf("devhost list has no resource %s", name)
	return devhost.Resource{}
}

func healthyIDs(r devhost.Resource) []string {
	var ids []string
	for _, d := range r.Devices {
		if d.Health == "Healthy" {
			ids = append(ids, d.ID)
		}
	}
	sort.Strings(ids)
	return ids
}

func assigned(k *kubelet, pod *v1.Pod, res string) []string {
	var ids []string
	for id := range k.dm.GetDevices(string(pod.UID), pod.Spec.Containers[0].Name)[res] {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

func TestDemoRegistersEveryResourceWithTheKubeletsDeviceManager(t *testing.T) {
	n := startNode(t, devhost.Options{})
	if len(n.list) != 7 {
		t.Fatalf("config/demo.toml: devhost list shows %d resources, want 7", len(n.list))
	}
	c, a := n.k.capacity()
	for _, r := range n.list {
		t.Logf("%-24s capacity %d allocatable %d", r.Resource, c[r.Resource], a[r.Resource])
		if r.Healthy == 0 {
			t.Errorf("%s: no healthy device in the demo", r.Resource)
		}
	}
}

// The kubelet asks devhost for its preferred devices, takes them, and hands the runtime
// exactly the edits devhost's Allocate gives for those devices.
func TestPodGetsDevhostsPreferredDevicesAndItsAllocateEdits(t *testing.T) {
	n := startNode(t, devhost.Options{})
	want := map[string]int64{"example.com/accel": 2, "nvidia.com/gpu": 1}
	preferred := map[string][]string{}
	for res, count := range want {
		ans, err := devhost.Plugin(t, pluginDir, res).GetPreferredAllocation(devhost.Ctx(t), preferredRequest(healthyIDs(n.resource(t, res)), int32(count)))
		if err != nil {
			t.Fatalf("%s: GetPreferredAllocation: %v", res, err)
		}
		ids := ans.ContainerResponses[0].DeviceIDs
		sort.Strings(ids)
		preferred[res] = ids
	}
	pod := newPod("accel-and-gpu", want)
	if res := n.k.admit(pod); !res.Admit {
		t.Fatalf("pod not admitted: %s: %s", res.Reason, res.Message)
	}
	for res := range want {
		if got := assigned(n.k, pod, res); strings.Join(got, ",") != strings.Join(preferred[res], ",") {
			t.Errorf("%s: kubelet assigned %v, devhost prefers %v", res, got, preferred[res])
		}
	}
	// The two accelerators devhost prefers share a NUMA node (the demo has two per node).
	numa := map[string]int{}
	for _, d := range n.resource(t, "example.com/accel").Devices {
		numa[d.ID] = *d.NUMANode
	}
	if p := preferred["example.com/accel"]; numa[p[0]] != numa[p[1]] {
		t.Errorf("preferred accelerators %v are on NUMA nodes %d and %d", p, numa[p[0]], numa[p[1]])
	}

	opts, err := n.k.dm.GetDeviceRunContainerOptions(context.Background(), pod, &pod.Spec.Containers[0])
	if err != nil {
		t.Fatal(err)
	}
	got := fromRunOptions(opts)
	wantEdits := edits{Env: map[string]string{}, Annotations: map[string]string{}}
	for res := range want {
		resp, err := devhost.Plugin(t, pluginDir, res).Allocate(devhost.Ctx(t), allocateRequest(preferred[res]))
		if err != nil {
			t.Fatalf("%s: Allocate: %v", res, err)
		}
		wantEdits.add(resp.ContainerResponses[0])
	}
	wantEdits.sort()
	if d := got.diff(wantEdits); d != "" {
		t.Errorf("container options from the kubelet differ from devhost's Allocate:\n%s", d)
	}
	gpu := preferred["nvidia.com/gpu"][0]
	if got.Env["NVIDIA_VISIBLE_DEVICES"] != gpu {
		t.Errorf("NVIDIA_VISIBLE_DEVICES = %q, want the assigned GPU %s", got.Env["NVIDIA_VISIBLE_DEVICES"], gpu)
	}
	if ev := got.Env["EXAMPLE_VISIBLE_DEVICES"]; sortedList(ev) != strings.Join(preferred["example.com/accel"], ",") {
		t.Errorf("EXAMPLE_VISIBLE_DEVICES = %q, want %v", ev, preferred["example.com/accel"])
	}
	if len(got.Devices) == 0 {
		t.Errorf("no device node handed to the runtime")
	}
}

func TestUnhealthyDeviceDropsAllocatableAndHealthyRestoresIt(t *testing.T) {
	n := startNode(t, devhost.Options{})
	const res = "example.com/accel"
	_, a := n.k.capacity()
	before := a[res]
	if err := os.WriteFile(n.health, []byte("example-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	took := devhost.Eventually(t, 10*time.Second, "allocatable drops by one", func() string {
		c, a := n.k.capacity()
		if a[res] != before-1 || c[res] != before {
			return fmt.Sprintf("capacity %d allocatable %d", c[res], a[res])
		}
		return ""
	})
	t.Logf("Unhealthy reached the kubelet's allocatable in %v", took.Round(time.Millisecond))
	if took > 3*time.Second {
		t.Errorf("Unhealthy took %v to reach the kubelet (want about a second)", took)
	}
	if err := os.WriteFile(n.health, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	took = devhost.Eventually(t, 10*time.Second, "allocatable restored", func() string {
		if _, a := n.k.capacity(); a[res] != before {
			return fmt.Sprintf("allocatable %d, want %d", a[res], before)
		}
		return ""
	})
	t.Logf("Healthy again reached the kubelet in %v", took.Round(time.Millisecond))
}

// A restarted kubelet removes every plugin socket; devhost registers every resource again and
// the checkpointed allocation of the admitted pod is kept.
func TestKubeletRestartKeepsCheckpointedDevicesAndDevhostRegistersAgain(t *testing.T) {
	n := startNode(t, devhost.Options{})
	pod := newPod("survivor", map[string]int64{"example.com/accel": 1, "google.com/tpu": 2})
	if res := n.k.admit(pod); !res.Admit {
		t.Fatalf("pod not admitted: %s: %s", res.Reason, res.Message)
	}
	before := map[string][]string{}
	for _, res := range []string{"example.com/accel", "google.com/tpu"} {
		before[res] = assigned(n.k, pod, res)
	}
	n.k.stop()
	start := time.Now()
	n.k = startKubelet(t, pod)
	took := n.k.waitForResources(t, n.list, 60*time.Second)
	t.Logf("kubelet restart: every resource registered again %v after the new kubelet started", took.Round(time.Millisecond))
	for res, ids := range before {
		if got := assigned(n.k, pod, res); strings.Join(got, ",") != strings.Join(ids, ",") {
			t.Errorf("%s: after restart the checkpoint gives %v, before %v", res, got, ids)
		}
	}
	if _, err := n.k.dm.GetDeviceRunContainerOptions(context.Background(), pod, &pod.Spec.Containers[0]); err != nil {
		t.Errorf("container options after restart: %v", err)
	}
	_ = start
}

func TestTooManyDevicesIsRefusedByTheKubelet(t *testing.T) {
	n := startNode(t, devhost.Options{})
	pod := newPod("greedy", map[string]int64{"example.com/accel": 5})
	res := n.k.admit(pod)
	if res.Admit {
		t.Fatal("a pod asking for 5 of 4 accelerators was admitted")
	}
	t.Logf("refused: %s: %s", res.Reason, res.Message)
	if !strings.Contains(res.Message, "requested number of devices unavailable for example.com/accel") {
		t.Errorf("unexpected refusal: %s", res.Message)
	}
}

func TestTPURequestThatIsNotABoxFailsAdmissionWithDevhostsMessage(t *testing.T) {
	n := startNode(t, devhost.Options{})
	pod := newPod("three-chips", map[string]int64{"google.com/tpu": 3})
	res := n.k.admit(pod)
	if res.Admit {
		t.Fatal("a 3-chip TPU request was admitted")
	}
	t.Logf("refused: %s: %s", res.Reason, res.Message)
	if !strings.Contains(res.Message, "3-chip TPU request is not a box") {
		t.Errorf("admission error does not carry devhost's message: %s", res.Message)
	}
	// A valid box on the same node is still admitted afterwards.
	if res := n.k.admit(newPod("four-chips", map[string]int64{"google.com/tpu": 4})); !res.Admit {
		t.Errorf("a 4-chip box after the refusal: %s: %s", res.Reason, res.Message)
	}
}
