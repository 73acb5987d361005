package containers_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

const pluginDir = "/var/lib/kubelet/device-plugins"

// exampleNodes are the real character devices the example_c driver's devices hand out
// (its dev_dir): misc devices (major 10) that root may open without a capability, none of them
// in the runtime's default device rules (runc allows /dev/net/tun, 10:200, to every container),
// so only a container given the device may open it: /dev/fuse, /dev/loop-control, /dev/kvm and
// /dev/btrfs-control.
var exampleNodes = []struct{ major, minor uint32 }{{10, 229}, {10, 237}, {10, 232}, {10, 234}}

// makeExampleNodes makes dir/example0..3 as the character devices of exampleNodes.
func makeExampleNodes(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for i, n := range exampleNodes {
		path := filepath.Join(dir, fmt.Sprintf("example%d", i))
		_ = os.Remove(path)
		if err := syscall.Mknod(path, syscall.S_IFCHR|0o666, devhost.Mkdev(n.major, n.minor)); err != nil {
			t.Fatalf("mknod %s: %v", path, err)
		}
	}
}

// node is a devhost started by startDevhost: the process, its manifest and what it lists.
type node struct {
	dh     *devhost.Process
	config string
	list   []devhost.Resource
}

// startDevhost runs devhost on the demo manifest (opts changing it), registered with the
// cluster's kubelet, and waits until the Node shows every resource.
func startDevhost(t *testing.T, opts devhost.Options) *node {
	t.Helper()
	needCluster(t)
	dir := t.TempDir()
	health, release := devhost.TestFiles(t, dir)
	opts.KubeletDir, opts.PodResourcesSocket = pluginDir, cluster.PodResourcesSocket
	opts.HealthFile, opts.ReleaseFile = health, release
	config := devhost.WriteDemoConfig(t, dir, opts)
	list := devhost.List(t, config)
	// The Node lags the kubelet by up to one status update: wait until it shows the previous
	// test's devhost gone (allocatable 0), or the wait below can pass on the old figures and a
	// pod be admitted before this devhost has registered (UnexpectedAdmissionError: "no healthy
	// devices present").
	waitNodeAllocatable(t, list, "the previous devhost gone from the Node", func(devhost.Resource) int { return 0 })
	n := &node{dh: devhost.Start(t, config), config: config, list: list}
	waitNodeShows(t, list)
	return n
}

// waitNodeShows waits until the Node's allocatable shows every healthy device of list.
func waitNodeShows(t *testing.T, list []devhost.Resource) {
	t.Helper()
	waitNodeAllocatable(t, list, "the Node shows every resource of devhost list", func(r devhost.Resource) int { return r.Healthy })
}

// waitNodeAllocatable waits until the Node's allocatable of each resource of list is want's.
func waitNodeAllocatable(t *testing.T, list []devhost.Resource, what string, want func(devhost.Resource) int) {
	t.Helper()
	devhost.Eventually(t, 60*time.Second, what, func() string {
		nd, err := cl.Node()
		if err != nil {
			return err.Error()
		}
		for _, r := range list {
			q := nd.Status.Allocatable[v1.ResourceName(r.Resource)]
			if q.Value() != int64(want(r)) {
				return fmt.Sprintf("%s: allocatable %d, want %d (devhost lists %d healthy)", r.Resource, q.Value(), want(r), r.Healthy)
			}
		}
		return ""
	})
}

// shellPod makes a pod on the node whose one container runs script in busybox's sh and then
// waits (exiting on SIGTERM), asking for limits, changed by mods; it is deleted when the test
// ends.
func shellPod(t *testing.T, name, script string, limits map[string]int64, mods ...func(*v1.Pod)) *v1.Pod {
	t.Helper()
	return scriptPod(t, name, script+"\necho done\ntrap 'exit 0' TERM\nwhile :; do sleep 1; done\n", limits, mods...)
}

// scriptPod makes a pod on the node whose one container runs script in busybox's sh, asking for
// limits, with a grace period of 2 s and restart policy Never, changed by mods; it is deleted
// when the test ends.
func scriptPod(t *testing.T, name, script string, limits map[string]int64, mods ...func(*v1.Pod)) *v1.Pod {
	t.Helper()
	rl := cluster.Limits(limits)
	no, grace := false, int64(2)
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.PodSpec{
			NodeName:                      cluster.NodeName,
			AutomountServiceAccountToken:  &no,
			TerminationGracePeriodSeconds: &grace,
			RestartPolicy:                 v1.RestartPolicyNever,
			// No cluster DNS here: the node's own resolver, without the kubelet's warning event.
			DNSPolicy: v1.DNSDefault,
			Containers: []v1.Container{{
				Name: "main", Image: cluster.BusyboxImage, ImagePullPolicy: v1.PullNever,
				Command:   []string{"/bin/sh", "-c", script},
				Resources: v1.ResourceRequirements{Limits: rl, Requests: rl},
			}},
		},
	}
	for _, m := range mods {
		m(pod)
	}
	created, err := cl.Client.CoreV1().Pods("default").Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deletePod(t, name) })
	return created
}

// containerOutput waits until the pod's container has printed "done" and returns what it
// printed before, one line each (the kubelet's log file of the container, in the CRI format
// "<time> <stream> <tag> <text>").
func containerOutput(t *testing.T, pod *v1.Pod, timeout time.Duration) []string {
	t.Helper()
	return attemptOutput(t, pod, 0, timeout)
}

// attemptOutput is containerOutput for the container's attempt-th start (0 the first; the
// kubelet keeps one log file per attempt).
func attemptOutput(t *testing.T, pod *v1.Pod, attempt int, timeout time.Duration) []string {
	t.Helper()
	glob := fmt.Sprintf("/var/log/pods/%s_%s_%s/main/%d.log", pod.Namespace, pod.Name, pod.UID, attempt)
	var lines []string
	devhost.Eventually(t, timeout, "pod "+pod.Name+"'s container printed its report", func() string {
		files, _ := filepath.Glob(glob)
		if len(files) == 0 {
			p, err := cl.Client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
			if err != nil {
				return err.Error()
			}
			return fmt.Sprintf("no log file %s yet; pod phase %s, %s", glob, p.Status.Phase, waitingReasons(p))
		}
		data, err := os.ReadFile(files[0])
		if err != nil {
			return err.Error()
		}
		lines = lines[:0]
		for _, l := range strings.Split(string(data), "\n") {
			if f := strings.SplitN(l, " ", 4); len(f) == 4 {
				if f[3] == "done" {
					return ""
				}
				lines = append(lines, f[3])
			}
		}
		return fmt.Sprintf("no \"done\" yet in %s: %q", files[0], lines)
	})
	return lines
}

func waitingReasons(p *v1.Pod) string {
	var out []string
	for _, s := range p.Status.ContainerStatuses {
		if w := s.State.Waiting; w != nil {
			out = append(out, fmt.Sprintf("%s: %s %s", s.Name, w.Reason, w.Message))
		}
	}
	return strings.Join(out, "; ")
}

func deletePod(t *testing.T, name string) { cl.DeletePod(t, name, nil) }

func getPod(t *testing.T, name string) *v1.Pod { return cl.Pod(t, name) }

// podTimeline is what happened to the pod since start, for a log: its events (time, source,
// reason, message) and its conditions' transitions, each as an offset from start, in order.
func podTimeline(t *testing.T, pod string, start time.Time) string {
	t.Helper()
	type entry struct {
		at   time.Time
		what string
	}
	var all []entry
	if evs, err := cl.Client.CoreV1().Events("default").List(context.Background(),
		metav1.ListOptions{FieldSelector: "involvedObject.name=" + pod}); err == nil {
		for _, e := range evs.Items {
			at := e.LastTimestamp.Time
			if at.IsZero() {
				at = e.EventTime.Time
			}
			all = append(all, entry{at, fmt.Sprintf("event %s/%s (%s, ×%d): %s", e.Source.Component, e.ReportingController,
				e.Reason, max(e.Count, 1), e.Message)})
		}
	}
	if p, err := cl.Client.CoreV1().Pods("default").Get(context.Background(), pod, metav1.GetOptions{}); err == nil {
		for _, c := range p.Status.Conditions {
			all = append(all, entry{c.LastTransitionTime.Time, fmt.Sprintf("condition %s=%s %s %s", c.Type, c.Status, c.Reason, c.Message)})
		}
	}
	sort.SliceStable(all, func(i, j int) bool { return all[i].at.Before(all[j].at) })
	var b strings.Builder
	for _, e := range all {
		fmt.Fprintf(&b, "  +%v %s\n", e.at.Sub(start).Round(time.Second), e.what)
	}
	return b.String()
}
