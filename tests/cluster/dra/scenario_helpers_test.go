package dra_test

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
	"devhost.test/cluster/internal/draapi"
)

var (
	deployOnce sync.Once
	deployErr  error
	deployed   []string // kind/name of what was applied
)

// applyDeployDRA applies (once per test binary) deploy/dra's DeviceClasses and RBAC
// (draapi.ApplyDeploy).
func applyDeployDRA(t *testing.T) {
	t.Helper()
	deployOnce.Do(func() { deployed, deployErr = draapi.ApplyDeploy(cl) })
	if deployErr != nil {
		t.Fatal(deployErr)
	}
}

// ensureDeviceClass makes a class of every device of driver, named after it, unless
// deploy/dra/ already made one.
func ensureDeviceClass(t *testing.T, driver string) {
	t.Helper()
	if _, err := cl.Client.ResourceV1().DeviceClasses().Get(ctx(), driver, metav1.GetOptions{}); err == nil {
		return
	} else if !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	createDeviceClass(t, driver, driver)
}

// startPublishing starts devhost with the API server (kubeconfig of the ServiceAccount
// kube-system/devhost, node_name) once deploy/dra/ is applied and the previous test's claims
// are gone, and waits until the kubelet has registered every DRA driver and every healthy
// device of each is published.
func startPublishing(t *testing.T, opts devhost.DRAOptions) *node {
	t.Helper()
	needCluster(t)
	applyDeployDRA(t)
	devhost.Eventually(t, 90*time.Second, "the previous tests' claims gone", func() string {
		list, err := cl.Client.ResourceV1().ResourceClaims(ns).List(ctx(), metav1.ListOptions{})
		if err != nil {
			return err.Error()
		}
		var left []string
		for _, c := range list.Items {
			left = append(left, c.Name+": "+claimSummary(&c))
		}
		if len(left) > 0 {
			return strings.Join(left, "\n")
		}
		return ""
	})
	n := startDRA(t, opts)
	for _, d := range n.draDrivers() {
		n.waitRegistered(t, d.driver, 1, 60*time.Second)
		took := n.waitSliceDevices(t, d.driver, n.healthyNames(t, d.resource), 60*time.Second)
		t.Logf("%s: every healthy device published %v after devhost started", d.driver, took.Round(time.Millisecond))
	}
	return n
}

type draDriver struct{ resource, driver string }

func (n *node) draDrivers() []draDriver {
	var out []draDriver
	if n.opts.GPU {
		out = append(out, draDriver{"nvidia.com/gpu", devhost.GPUDriver})
	}
	if n.opts.Accel {
		out = append(out, draDriver{"example.com/accel", devhost.AccelDriver})
	}
	return out
}

// healthyNames is the DRA device names of the resource's Healthy devices (devhost list, at
// the start), except those in skip.
func (n *node) healthyNames(t *testing.T, resource string, skip ...string) []string {
	t.Helper()
	var out []string
	for _, d := range n.resource(t, resource).Devices {
		if d.Health == "Healthy" && !contains(skip, d.ID) {
			out = append(out, devhost.DRADeviceName(d.ID))
		}
	}
	sort.Strings(out)
	return out
}

// deviceByName is the device (devhost list) of a resource whose DRA name is name.
func (n *node) deviceByName(t *testing.T, resource, name string) devhost.Device {
	t.Helper()
	for _, d := range n.resource(t, resource).Devices {
		if devhost.DRADeviceName(d.ID) == name {
			return d
		}
	}
	t.Fatalf("%s: no device of devhost list is named %s in DRA", resource, name)
	return devhost.Device{}
}

func readPool(t *testing.T, driver string) draapi.Pool { return draapi.ReadPool(t, cl, driver) }

// waitSliceDevices waits until the node's pool of driver (pool name = node name, spec.nodeName
// set) is complete and offers exactly the devices named want.
func (n *node) waitSliceDevices(t *testing.T, driver string, want []string, timeout time.Duration) time.Duration {
	t.Helper()
	return devhost.Eventually(t, timeout, "ResourceSlices of "+driver+" offer exactly "+strings.Join(want, ","), func() string {
		p := readPool(t, driver)
		if p.Complete && strings.Join(p.Names(), ",") == strings.Join(want, ",") {
			return ""
		}
		return fmt.Sprintf("pool %s complete=%v offers %v\n%sdevhost log tail:\n%s",
			cluster.NodeName, p.Complete, p.Names(), slicesSummary(driver), n.logTail(20))
	})
}

// waitTaints waits until the node's pool of driver is complete and its devices' taints are
// exactly want (device name → taint key), and returns how long it took.
func (n *node) waitTaints(t *testing.T, driver string, want map[string]string, timeout time.Duration) time.Duration {
	t.Helper()
	return devhost.Eventually(t, timeout, fmt.Sprintf("ResourceSlices of %s with taints %v", driver, want), func() string {
		p := readPool(t, driver)
		got := map[string]string{}
		for name, d := range p.Devices {
			for _, taint := range d.Taints {
				got[name] = taint.Key
			}
		}
		if p.Complete && fmt.Sprint(got) == fmt.Sprint(want) {
			return ""
		}
		return fmt.Sprintf("pool %s complete=%v has taints %v\n%sdevhost log tail:\n%s",
			cluster.NodeName, p.Complete, got, slicesSummary(driver), n.logTail(20))
	})
}

// attr is a device's attribute id of the driver's domain (qualified or not, both mean the
// same to CEL).
func attr(d resourcev1.Device, driver, id string) (resourcev1.DeviceAttribute, bool) {
	if a, ok := d.Attributes[resourcev1.QualifiedName(driver+"/"+id)]; ok {
		return a, true
	}
	a, ok := d.Attributes[resourcev1.QualifiedName(id)]
	return a, ok
}

// waitPodRunning waits until the pod runs; the failure names the pod's state, its claims and
// events, the slices and devhost's log tail.
func (n *node) waitPodRunning(t *testing.T, name string, timeout time.Duration) *v1.Pod {
	t.Helper()
	var p *v1.Pod
	devhost.Eventually(t, timeout, "pod "+name+" Running", func() string {
		if p = getPod(t, name); p.Status.Phase == v1.PodRunning {
			return ""
		}
		return "\n" + describe(name, n)
	})
	return p
}

// waitUnschedulable waits until the scheduler marks the pod Unschedulable and returns its
// message.
func waitUnschedulable(t *testing.T, n *node, name string, timeout time.Duration) string {
	t.Helper()
	var msg string
	devhost.Eventually(t, timeout, "pod "+name+" Unschedulable", func() string {
		for _, c := range getPod(t, name).Status.Conditions {
			if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
				msg = c.Message
				return ""
			}
		}
		return "\n" + describe(name, n)
	})
	return msg
}

// allocated is the claim's allocation results of driver, as device names (sorted); the test
// fails if the claim is not allocated.
func allocated(t *testing.T, c *resourcev1.ResourceClaim, driver string) []string {
	t.Helper()
	if c == nil || c.Status.Allocation == nil {
		t.Fatalf("claim not allocated: %+v", c)
	}
	var out []string
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != driver || r.Pool != cluster.NodeName {
			t.Errorf("claim %s: result %s -> %s/%s/%s, want driver %s, pool %s", c.Name, r.Request, r.Driver, r.Pool, r.Device,
				driver, cluster.NodeName)
			continue
		}
		out = append(out, r.Device)
	}
	sort.Strings(out)
	return out
}

// cdiDeviceNodes resolves each CDI name (kind=device) in the specs of devhost's cdi_dir, read
// and checked by the reference library, and returns the container paths of the device nodes
// each one's edits add (its own and its spec's). An unresolved name fails the test.
func (n *node) cdiDeviceNodes(t *testing.T, names []string) map[string][]string {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(n.opts.CDIDir, "*.json"))
	specs := map[string]*cdi.Spec{}
	for _, f := range files {
		s, err := cdi.ReadSpec(f, 0)
		if err != nil {
			t.Errorf("the CDI library refuses %s: %v", f, err)
			continue
		}
		specs[s.Kind] = s
	}
	out := map[string][]string{}
	for _, name := range names {
		kind, dev, ok := strings.Cut(name, "=")
		s := specs[kind]
		if !ok || s == nil {
			t.Fatalf("CDI device %s: no spec of kind %q in %s (files %v)", name, kind, n.opts.CDIDir, files)
		}
		found := false
		for _, d := range s.Devices {
			if d.Name != dev {
				continue
			}
			found = true
			for _, dn := range d.ContainerEdits.DeviceNodes {
				out[name] = append(out[name], dn.Path)
			}
			for _, dn := range s.ContainerEdits.DeviceNodes {
				out[name] = append(out[name], dn.Path)
			}
		}
		if !found {
			t.Fatalf("CDI device %s: spec %s has no device %q", name, s.GetPath(), dev)
		}
	}
	return out
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(data)
}
