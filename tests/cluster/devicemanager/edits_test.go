package devicemanager_test

import (
	"fmt"
	"sort"
	"strings"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// edits is what a container gets from its devices, in a form both the kubelet's run options
// and devhost's Allocate answers reduce to.
type edits struct {
	Env         map[string]string
	Devices     []string // "host -> container (perms)"
	Mounts      []string // "host -> container (ro|rw)"
	Annotations map[string]string
	CDI         []string
}

func fromRunOptions(o *devicemanager.DeviceRunContainerOptions) edits {
	e := edits{Env: map[string]string{}, Annotations: map[string]string{}}
	for _, v := range o.Envs {
		e.Env[v.Name] = v.Value
	}
	for _, d := range o.Devices {
		e.Devices = append(e.Devices, fmt.Sprintf("%s -> %s (%s)", d.PathOnHost, d.PathInContainer, d.Permissions))
	}
	for _, m := range o.Mounts {
		e.Mounts = append(e.Mounts, fmt.Sprintf("%s -> %s (%s)", m.HostPath, m.ContainerPath, roRW(m.ReadOnly)))
	}
	for _, a := range o.Annotations {
		e.Annotations[a.Name] = a.Value
	}
	for _, c := range o.CDIDevices {
		e.CDI = append(e.CDI, c.Name)
	}
	e.sort()
	return e
}

func (e *edits) add(r *pluginapi.ContainerAllocateResponse) {
	for k, v := range r.Envs {
		e.Env[k] = v
	}
	for _, d := range r.Devices {
		e.Devices = append(e.Devices, fmt.Sprintf("%s -> %s (%s)", d.HostPath, d.ContainerPath, d.Permissions))
	}
	for _, m := range r.Mounts {
		e.Mounts = append(e.Mounts, fmt.Sprintf("%s -> %s (%s)", m.HostPath, m.ContainerPath, roRW(m.ReadOnly)))
	}
	for k, v := range r.Annotations {
		e.Annotations[k] = v
	}
	for _, c := range r.CdiDevices {
		e.CDI = append(e.CDI, c.Name)
	}
}

func (e *edits) sort() {
	e.Devices = dedupSorted(e.Devices)
	e.Mounts = dedupSorted(e.Mounts)
	e.CDI = dedupSorted(e.CDI)
}

func dedupSorted(s []string) []string {
	sort.Strings(s)
	var out []string
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}

func roRW(ro bool) string {
	if ro {
		return "ro"
	}
	return "rw"
}

// diff lists every difference, one per line; "" when equal.
func (e edits) diff(want edits) string {
	var out []string
	mapDiff := func(kind string, got, want map[string]string) {
		for k, v := range want {
			if g, ok := got[k]; !ok || sortedList(g) != sortedList(v) {
				out = append(out, fmt.Sprintf("%s %s: got %q, want %q", kind, k, g, v))
			}
		}
		for k, v := range got {
			if _, ok := want[k]; !ok {
				out = append(out, fmt.Sprintf("%s %s=%q: not expected", kind, k, v))
			}
		}
	}
	listDiff := func(kind string, got, want []string) {
		if strings.Join(got, "\n") != strings.Join(want, "\n") {
			out = append(out, fmt.Sprintf("%s:\n  got  %q\n  want %q", kind, got, want))
		}
	}
	mapDiff("env", e.Env, want.Env)
	mapDiff("annotation", e.Annotations, want.Annotations)
	listDiff("devices", e.Devices, want.Devices)
	listDiff("mounts", e.Mounts, want.Mounts)
	listDiff("cdi devices", e.CDI, want.CDI)
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// sortedList sorts a comma-separated list. The kubelet sends a container's device IDs in the
// iteration order of a Go set (random), and devhost joins list variables such as
// X_VISIBLE_DEVICES in request order, so only the set of values is stable.
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

func allocateRequest(ids []string) *pluginapi.AllocateRequest {
	return &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}}
}
