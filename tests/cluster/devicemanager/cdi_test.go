package devicemanager_test

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"devhost.test/cluster/internal/devhost"
)

// admitted is what one pod got in one run of the demo node.
type admitted struct {
	ids  map[string][]string // resource -> device IDs
	opts *devicemanager.DeviceRunContainerOptions
}

// cdiPods are admitted in order, each after the previous one is gone: for every resource, one
// device (devhost's preferred one), then all of its devices. One resource per pod: the kubelet
// keeps only one value of an env key that two resources of a container set (nvidia.com/gpu and
// nvidia.com/mig-1g.10gb both set NVIDIA_VISIBLE_DEVICES), picked in map order.
func cdiPods(list []devhost.Resource) []*v1.Pod {
	var pods []*v1.Pod
	for _, r := range list {
		name := strings.NewReplacer("/", "-", ".", "-").Replace(r.Resource)
		pods = append(pods,
			newPod("one-"+name, map[string]int64{r.Resource: 1}),
			newPod("all-"+name, map[string]int64{r.Resource: int64(r.Healthy)}))
	}
	return pods
}

func runDemo(t *testing.T, opts devhost.Options) (names []string, out []admitted) {
	n := startNode(t, opts)
	for _, pod := range cdiPods(n.list) {
		names = append(names, pod.Name)
		if res := n.k.admit(pod); !res.Admit {
			t.Fatalf("%s not admitted: %s: %s", pod.Name, res.Reason, res.Message)
		}
		o, err := n.k.dm.GetDeviceRunContainerOptions(t.Context(), pod, &pod.Spec.Containers[0])
		if err != nil {
			t.Fatal(err)
		}
		a := admitted{ids: map[string][]string{}, opts: o}
		for _, r := range n.list {
			a.ids[r.Resource] = assigned(n.k, pod, r.Resource)
		}
		out = append(out, a)
		// The pod is gone: the kubelet frees its devices.
		n.k.mu.Lock()
		n.k.pods = nil
		n.k.mu.Unlock()
		n.k.dm.UpdateAllocatedDevices(logger)
	}
	return names, out
}

// Every spec devhost writes loads in the reference CDI library; every CDI name Allocate returns
// resolves; injected into an empty OCI spec (with what Allocate returns besides the names) the
// container gets exactly what the "edits" strategy gives it.
func TestCDISpecsResolvedByTheReferenceLibraryEqualTheEditsStrategy(t *testing.T) {
	var pods []string
	var plain, viaCDI []admitted
	t.Run("edits", func(t *testing.T) { pods, plain = runDemo(t, devhost.Options{}) })
	cdiDir := t.TempDir()
	var cache *cdi.Cache
	t.Run("cdi", func(t *testing.T) {
		_, viaCDI = runDemo(t, devhost.Options{CDIDir: cdiDir})
		cache = loadSpecs(t, cdiDir)
	})
	sameContainers(t, pods, plain, viaCDI, cache, func(string) bool { return true })
}

// The NVIDIA driver's own "cdi" strategy (nvidia.com/gpu=<uuid>, as NVIDIA's plugin names
// devices): devhost defines those names in its spec from what the driver knows, so they resolve
// in the reference library and give the container what the driver's "device-nodes" strategy
// gives it, while the resources keep the "edits" strategy.
func TestNvidiaCDIStrategyNamesResolveToTheDeviceNodesStrategy(t *testing.T) {
	var pods []string
	var plain, viaCDI []admitted
	t.Run("device-nodes", func(t *testing.T) { pods, plain = runDemo(t, devhost.Options{}) })
	cdiDir := t.TempDir()
	var cache *cdi.Cache
	t.Run("cdi", func(t *testing.T) {
		_, viaCDI = runDemo(t, devhost.Options{CDIDir: cdiDir, NvidiaCDI: true})
		cache = loadSpecs(t, cdiDir)
	})
	sameContainers(t, pods, plain, viaCDI, cache, func(pod string) bool { return strings.Contains(pod, "nvidia-com") })
}

// loadSpecs reads devhost's specs (as it wrote them for this run; a stopping devhost keeps
// them) with the reference library, from a copy of the folder so that nothing else is in it.
func loadSpecs(t *testing.T, cdiDir string) *cdi.Cache {
	files, _ := filepath.Glob(filepath.Join(cdiDir, "devhost-*.json"))
	if len(files) == 0 {
		t.Fatalf("devhost wrote no CDI spec into %s", cdiDir)
	}
	for _, f := range files {
		spec, err := cdi.ReadSpec(f, 0)
		if err != nil {
			t.Errorf("the CDI library refuses %s: %v", filepath.Base(f), err)
			continue
		}
		t.Logf("%s: kind %s, cdiVersion %s, %d device(s)", filepath.Base(f), spec.Kind, spec.Version, len(spec.Devices))
	}
	copyDir := t.TempDir()
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(copyDir, filepath.Base(f)), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(copyDir), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatalf("CDI cache on devhost's specs: %v", err)
	}
	for path, errs := range cache.GetErrors() {
		t.Errorf("CDI cache: %s: %v", path, errs)
	}
	return cache
}

// sameContainers checks, pod by pod, that the CDI run's names resolve in cache and, injected
// with the rest of its answer, give the container the plain run's env, nodes and mounts. A pod
// for which wantNames is true must have been given CDI names.
func sameContainers(t *testing.T, pods []string, plain, viaCDI []admitted, cache *cdi.Cache, wantNames func(string) bool) {
	t.Helper()
	if t.Failed() || len(plain) != len(viaCDI) {
		t.FailNow()
	}
	for i, pod := range pods {
		for res, ids := range plain[i].ids {
			if strings.Join(ids, ",") != strings.Join(viaCDI[i].ids[res], ",") {
				t.Fatalf("%s: %s got %v in one run and %v in the other: cannot compare", pod, res, ids, viaCDI[i].ids[res])
			}
		}
		o := viaCDI[i].opts
		if len(o.CDIDevices) == 0 && wantNames(pod) {
			t.Fatalf("%s: Allocate returned no CDI name", pod)
		}
		var names []string
		for _, d := range o.CDIDevices {
			names = append(names, d.Name)
		}
		spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
		applyRunOptions(spec, o)
		unresolved, err := cache.InjectDevices(spec, names...)
		if err != nil {
			t.Fatalf("%s: injecting %v: %v (unresolved %v)", pod, names, err, unresolved)
		}
		want := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
		applyRunOptions(want, plain[i].opts)
		if d := diffOCI(spec, want); d != "" {
			t.Errorf("%s: CDI (%d names) and the plain run give different containers:\n%s", pod, len(names), d)
		} else {
			t.Logf("%s: %d CDI names resolve to the plain run's container (%d env, %d devices, %d mounts)",
				pod, len(names), len(want.Process.Env), len(want.Linux.Devices), len(want.Mounts))
		}
	}
}

// applyRunOptions does what a container runtime does with the kubelet's CRI options: env,
// device nodes (type and numbers from the host node), bind mounts.
func applyRunOptions(s *oci.Spec, o *devicemanager.DeviceRunContainerOptions) {
	for _, e := range o.Envs {
		s.Process.Env = append(s.Process.Env, e.Name+"="+e.Value)
	}
	for _, d := range o.Devices {
		s.Linux.Devices = append(s.Linux.Devices, oci.LinuxDevice{Path: d.PathInContainer, Type: "c"})
	}
	for _, m := range o.Mounts {
		opt := "rw"
		if m.ReadOnly {
			opt = "ro"
		}
		s.Mounts = append(s.Mounts, oci.Mount{Source: m.HostPath, Destination: m.ContainerPath, Options: []string{opt}})
	}
}

// diffOCI compares what a process in the container sees: its environment (no key may be set
// twice to different values), its device nodes by path, its mounts by source, destination and
// ro/rw.
func diffOCI(got, want *oci.Spec) string {
	var out []string
	envMap := func(s *oci.Spec) map[string]string {
		m := map[string]string{}
		for _, kv := range s.Process.Env {
			k, v, _ := strings.Cut(kv, "=")
			if old, ok := m[k]; ok && old != v {
				out = append(out, fmt.Sprintf("env %s set twice: %q and %q", k, old, v))
			}
			m[k] = v
		}
		return m
	}
	g, w := envMap(got), envMap(want)
	for k, v := range w {
		if sortedList(g[k]) != sortedList(v) {
			out = append(out, fmt.Sprintf("env %s: got %q, want %q", k, g[k], v))
		}
	}
	for k, v := range g {
		if _, ok := w[k]; !ok {
			out = append(out, fmt.Sprintf("env %s=%q: not in the edits strategy", k, v))
		}
	}
	devs := func(s *oci.Spec) []string {
		var l []string
		for _, d := range s.Linux.Devices {
			l = append(l, d.Path)
		}
		return dedupSorted(l)
	}
	mounts := func(s *oci.Spec) []string {
		var l []string
		for _, m := range s.Mounts {
			ro := "rw"
			for _, o := range m.Options {
				if o == "ro" {
					ro = "ro"
				}
			}
			l = append(l, fmt.Sprintf("%s -> %s (%s)", m.Source, m.Destination, ro))
		}
		return dedupSorted(l)
	}
	if a, b := devs(got), devs(want); strings.Join(a, " ") != strings.Join(b, " ") {
		out = append(out, fmt.Sprintf("device nodes:\n  got  %v\n  want %v", a, b))
	}
	if a, b := mounts(got), mounts(want); strings.Join(a, "\n") != strings.Join(b, "\n") {
		out = append(out, fmt.Sprintf("mounts:\n  got  %q\n  want %q", a, b))
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}
