package node_test

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

const pluginDir = "/var/lib/kubelet/device-plugins"

// node is devhost on the demo manifest, registered with the cluster's kubelet.
type node struct {
	dh      *devhost.Process
	config  string
	list    []devhost.Resource
	health  string
	release string
}

func startDevhost(t *testing.T) *node { return startDevhostCDI(t, "") }

// startDevhostCDI starts devhost with device_list_strategy = "cdi" and cdi_dir = cdiDir
// ("" = the demo's "edits").
func startDevhostCDI(t *testing.T, cdiDir string) *node {
	t.Helper()
	return startDevhostWith(t, devhost.Options{CDIDir: cdiDir})
}

// startDevhostWith starts devhost on the demo manifest changed by opts; the kubelet folders,
// the health file and the release record are the test's own.
func startDevhostWith(t *testing.T, opts devhost.Options) *node {
	t.Helper()
	needCluster(t)
	dir := t.TempDir()
	n := &node{}
	n.health, n.release = devhost.TestFiles(t, dir)
	opts.KubeletDir, opts.PodResourcesSocket = pluginDir, cluster.PodResourcesSocket
	opts.HealthFile, opts.ReleaseFile = n.health, n.release
	n.config = devhost.WriteDemoConfig(t, dir, opts)
	n.list = devhost.List(t, n.config)
	// The Node lags the kubelet by up to one status update: wait until it shows the previous
	// test's devhost gone (allocatable 0), so that the wait below sees this devhost register
	// and a pod is not admitted before the kubelet has its endpoints again.
	devhost.Eventually(t, 30*time.Second, "the previous devhost gone from the Node", func() string {
		_, a := nodeCounts(t)
		for _, r := range n.list {
			if a[r.Resource] != 0 {
				return fmt.Sprintf("%s: allocatable %d", r.Resource, a[r.Resource])
			}
		}
		return ""
	})
	n.dh = devhost.Start(t, n.config)
	took := waitNodeResources(t, n.list, 60*time.Second)
	t.Logf("the Node shows every resource %v after devhost started", took.Round(time.Millisecond))
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

// nodeCounts is the Node's capacity and allocatable per extended resource.
func nodeCounts(t *testing.T) (map[string]int64, map[string]int64) {
	t.Helper()
	nd, err := cl.Node()
	if err != nil {
		t.Fatal(err)
	}
	c, a := map[string]int64{}, map[string]int64{}
	for k, q := range nd.Status.Capacity {
		c[string(k)] = q.Value()
	}
	for k, q := range nd.Status.Allocatable {
		a[string(k)] = q.Value()
	}
	return c, a
}

func waitNodeResources(t *testing.T, want []devhost.Resource, timeout time.Duration) time.Duration {
	t.Helper()
	return devhost.Eventually(t, timeout, "the Node's capacity and allocatable equal devhost list", func() string {
		c, a := nodeCounts(t)
		for _, r := range want {
			if c[r.Resource] != int64(r.Healthy+r.Unhealthy) || a[r.Resource] != int64(r.Healthy) {
				return fmt.Sprintf("%s: capacity %d allocatable %d, devhost lists %d healthy + %d unhealthy",
					r.Resource, c[r.Resource], a[r.Resource], r.Healthy, r.Unhealthy)
			}
		}
		return ""
	})
}

// createPod makes a pod bound to the node by spec.nodeName (there is no scheduler), and
// deletes it when the test ends.
func createPod(t *testing.T, name string, limits map[string]int64) *v1.Pod {
	t.Helper()
	rl := cluster.Limits(limits)
	no := false
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.PodSpec{
			NodeName:                     cluster.NodeName,
			AutomountServiceAccountToken: &no,
			Containers: []v1.Container{{
				Name: "main", Image: "devhost.test/pause:1", ImagePullPolicy: v1.PullIfNotPresent,
				Resources: v1.ResourceRequirements{Limits: rl, Requests: rl},
			}},
		},
	}
	ctx := context.Background()
	created, err := cl.Client.CoreV1().Pods("default").Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deletePod(t, name) })
	return created
}

func waitPodPhase(t *testing.T, name string, phase v1.PodPhase, timeout time.Duration) *v1.Pod {
	t.Helper()
	var p *v1.Pod
	devhost.Eventually(t, timeout, "pod "+name+" "+string(phase), func() string {
		p = getPod(t, name)
		if p.Status.Phase == phase {
			return ""
		}
		return fmt.Sprintf("phase %q reason %q message %q", p.Status.Phase, p.Status.Reason, p.Status.Message)
	})
	return p
}

func podDevices(t *testing.T, name string) map[string][]string {
	t.Helper()
	d, err := cluster.PodDevices("default", name)
	if err != nil {
		t.Fatal(err)
	}
	for _, ids := range d {
		sort.Strings(ids)
	}
	return d
}

func preferred(t *testing.T, n *node, res string, count int32) []string {
	t.Helper()
	var avail []string
	for _, d := range n.resource(t, res).Devices {
		if d.Health == "Healthy" {
			avail = append(avail, d.ID)
		}
	}
	ans, err := devhost.Plugin(t, pluginDir, res).GetPreferredAllocation(devhost.Ctx(t), preferredRequest(avail, count))
	if err != nil {
		t.Fatalf("%s: GetPreferredAllocation: %v", res, err)
	}
	ids := ans.ContainerResponses[0].DeviceIDs
	sort.Strings(ids)
	return ids
}

func sortedList(v string) string {
	l := strings.Split(v, ",")
	sort.Strings(l)
	return strings.Join(l, ",")
}

func preferredRequest(available []string, size int32) *pluginapi.PreferredAllocationRequest {
	return &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
		AvailableDeviceIDs: available, AllocationSize: size,
	}}}
}

func allocate(t *testing.T, res string, ids []string) *pluginapi.ContainerAllocateResponse {
	t.Helper()
	resp, err := devhost.Plugin(t, pluginDir, res).Allocate(devhost.Ctx(t),
		&pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		t.Fatalf("%s: Allocate(%v): %v", res, ids, err)
	}
	return resp.ContainerResponses[0]
}

func deletePod(t *testing.T, name string) {
	zero := int64(0)
	cl.DeletePod(t, name, &zero)
}

func getPod(t *testing.T, name string) *v1.Pod { return cl.Pod(t, name) }
