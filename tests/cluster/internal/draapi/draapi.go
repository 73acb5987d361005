// Package draapi holds the Dynamic Resource Allocation objects the cluster tests make through
// the API server (deploy/dra's RBAC and DeviceClasses, claim templates and their requests) and
// what they read back (the node's pool of a driver; summaries of slices and claims for failure
// messages). Both dra/ (on fakecri) and containers/ (on containerd) use it.
package draapi

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

func ctx() context.Context { return context.Background() }

// DeployKinds are the kinds of deploy/dra/ the tests apply (the cluster-wide DRA objects and
// RBAC); anything else there (a DaemonSet patch: the tests run devhost themselves) is left out.
var DeployKinds = map[string]bool{
	"Namespace": true, "ServiceAccount": true, "ClusterRole": true, "ClusterRoleBinding": true,
	"Role": true, "RoleBinding": true, "DeviceClass": true,
	"ValidatingAdmissionPolicy": true, "ValidatingAdmissionPolicyBinding": true,
}

// ApplyDeploy applies the objects of deploy/dra/*.yaml whose kind is in DeployKinds, as
// cluster admin (kubectl apply), and returns what it applied as "kind/name (file)".
func ApplyDeploy(c *cluster.Cluster) ([]string, error) {
	dir := filepath.Join(devhost.Root(), "deploy", "dra")
	files, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	more, _ := filepath.Glob(filepath.Join(dir, "*.yml"))
	files = append(files, more...)
	sort.Strings(files)
	var docs, applied []string
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		for _, doc := range strings.Split("\n"+string(data), "\n---") {
			kind, name := topLevel(doc, "kind"), topLevel(doc, "name")
			if DeployKinds[kind] {
				docs = append(docs, doc)
				applied = append(applied, fmt.Sprintf("%s/%s (%s)", kind, name, filepath.Base(f)))
			}
		}
	}
	if len(docs) == 0 {
		return nil, fmt.Errorf("%s holds no DeviceClass or RBAC object (files %v): the DRA scenarios rely on them", dir, files)
	}
	cmd := exec.Command(filepath.Join(c.Bin, "kubectl"), "--kubeconfig", c.AdminKubeconfig, "apply", "-f", "-")
	cmd.Stdin = strings.NewReader(strings.Join(docs, "\n---\n"))
	if out, err := cmd.CombinedOutput(); err != nil {
		return applied, fmt.Errorf("kubectl apply of deploy/dra (%v): %v\n%s", applied, err, out)
	}
	return applied, nil
}

// topLevel is the value of the first line `key: value` of a YAML document at the top level
// (kind) or one level in (metadata's name); enough to sort deploy/dra's documents.
func topLevel(doc, key string) string {
	for _, line := range strings.Split(doc, "\n") {
		trimmed := strings.TrimLeft(line, " ")
		if len(line)-len(trimmed) <= 2 && strings.HasPrefix(trimmed, key+":") {
			return strings.Trim(strings.TrimSpace(strings.TrimPrefix(trimmed, key+":")), `"'`)
		}
	}
	return ""
}

// Request is one device request of a claim: count devices of class, each matching every CEL
// expression.
func Request(name, class string, count int64, cel ...string) resourcev1.DeviceRequest {
	var sel []resourcev1.DeviceSelector
	for _, e := range cel {
		sel = append(sel, resourcev1.DeviceSelector{CEL: &resourcev1.CELDeviceSelector{Expression: e}})
	}
	return resourcev1.DeviceRequest{Name: name, Exactly: &resourcev1.ExactDeviceRequest{
		DeviceClassName: class, Selectors: sel,
		AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: count,
	}}
}

// CreateClaimTemplate makes a ResourceClaimTemplate in ns (deleted when the test ends).
func CreateClaimTemplate(t *testing.T, c *cluster.Cluster, ns, name string, devices resourcev1.DeviceClaim) {
	t.Helper()
	tmpl := &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: devices}},
	}
	if _, err := c.Client.ResourceV1().ResourceClaimTemplates(ns).Create(ctx(), tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatalf("ResourceClaimTemplate %s: %v", name, err)
	}
	t.Cleanup(func() {
		_ = c.Client.ResourceV1().ResourceClaimTemplates(ns).Delete(ctx(), name, metav1.DeleteOptions{})
	})
}

// Pool is the node's pool of a driver as a consumer sees it: the slices of the highest
// generation, complete when there are resourceSliceCount of them.
type Pool struct {
	Slices   []resourcev1.ResourceSlice
	Devices  map[string]resourcev1.Device
	Complete bool
}

// ReadPool lists the ResourceSlices of driver (as admin) and returns the node's pool (pool
// name = node name, spec.nodeName set).
func ReadPool(t *testing.T, c *cluster.Cluster, driver string) Pool {
	t.Helper()
	list, err := c.Client.ResourceV1().ResourceSlices().List(ctx(), metav1.ListOptions{FieldSelector: "spec.driver=" + driver})
	if err != nil {
		t.Fatalf("listing ResourceSlices of %s (as admin): %v", driver, err)
	}
	p := Pool{Devices: map[string]resourcev1.Device{}}
	gen := int64(-1)
	for _, s := range list.Items {
		if s.Spec.NodeName == nil || *s.Spec.NodeName != cluster.NodeName || s.Spec.Pool.Name != cluster.NodeName {
			continue
		}
		if s.Spec.Pool.Generation > gen {
			gen, p.Slices = s.Spec.Pool.Generation, nil
		}
		if s.Spec.Pool.Generation == gen {
			p.Slices = append(p.Slices, s)
		}
	}
	for _, s := range p.Slices {
		p.Complete = int64(len(p.Slices)) == s.Spec.Pool.ResourceSliceCount
		for _, d := range s.Spec.Devices {
			p.Devices[d.Name] = d
		}
	}
	return p
}

// Names is the pool's device names, sorted.
func (p Pool) Names() []string {
	var out []string
	for name := range p.Devices {
		out = append(out, name)
	}
	sort.Strings(out)
	return out
}

// ClaimSummary is a claim's allocation results and reservedFor.
func ClaimSummary(c *resourcev1.ResourceClaim) string {
	var parts []string
	if c.Status.Allocation == nil {
		parts = append(parts, "not allocated")
	} else {
		for _, r := range c.Status.Allocation.Devices.Results {
			parts = append(parts, fmt.Sprintf("%s -> %s/%s/%s", r.Request, r.Driver, r.Pool, r.Device))
		}
	}
	var users []string
	for _, r := range c.Status.ReservedFor {
		users = append(users, r.Resource+"/"+r.Name)
	}
	return fmt.Sprintf("%s; reservedFor %v; annotations %v", strings.Join(parts, ", "), users, c.Annotations)
}

// SlicesSummary lists every ResourceSlice (of driver, or all with ""): name, node, pool,
// generation, count, and each device with its attributes and capacity.
func SlicesSummary(c *cluster.Cluster, driver string) string {
	opts := metav1.ListOptions{}
	if driver != "" {
		opts.FieldSelector = "spec.driver=" + driver
	}
	list, err := c.Client.ResourceV1().ResourceSlices().List(ctx(), opts)
	if err != nil {
		return fmt.Sprintf("ResourceSlices: %v\n", err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d ResourceSlice(s)", len(list.Items))
	if driver != "" {
		fmt.Fprintf(&b, " of driver %s", driver)
	}
	b.WriteString(":\n")
	for _, s := range list.Items {
		fmt.Fprintf(&b, "  slice %s: driver %s node %v pool %s generation %d count %d, %d device(s)\n", s.Name, s.Spec.Driver,
			ptrString(s.Spec.NodeName), s.Spec.Pool.Name, s.Spec.Pool.Generation, s.Spec.Pool.ResourceSliceCount, len(s.Spec.Devices))
		for _, d := range s.Spec.Devices {
			var attrs []string
			for k, a := range d.Attributes {
				attrs = append(attrs, fmt.Sprintf("%s=%s", k, AttrString(a)))
			}
			for k, c := range d.Capacity {
				attrs = append(attrs, fmt.Sprintf("capacity %s=%s", k, c.Value.String()))
			}
			sort.Strings(attrs)
			fmt.Fprintf(&b, "    %s: %s\n", d.Name, strings.Join(attrs, " "))
		}
	}
	return b.String()
}

// AttrString is a device attribute with its type: int(1), string("x"), ...
func AttrString(a resourcev1.DeviceAttribute) string {
	switch {
	case a.IntValue != nil:
		return fmt.Sprintf("int(%d)", *a.IntValue)
	case a.BoolValue != nil:
		return fmt.Sprintf("bool(%v)", *a.BoolValue)
	case a.StringValue != nil:
		return fmt.Sprintf("string(%q)", *a.StringValue)
	case a.VersionValue != nil:
		return fmt.Sprintf("version(%s)", *a.VersionValue)
	}
	return "?"
}

func ptrString(s *string) string {
	if s == nil {
		return "<none>"
	}
	return *s
}
