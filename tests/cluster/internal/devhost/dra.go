package devhost

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The DRA driver names of the resources WriteDRAConfig serves (the derived names: the
// resource's name part, then its domain; host/src/manifest/dra.rs).
const (
	GPUDriver   = "gpu.nvidia.com"    // nvidia.com/gpu
	AccelDriver = "accel.example.com" // example.com/accel
)

// DRAOptions describe a manifest with Dynamic Resource Allocation resources (WriteDRAConfig).
type DRAOptions struct {
	KubeletRootDir     string // kubelet_root_dir ("" = the default, /var/lib/kubelet)
	KubeletDir         string // kubelet_dir (device-plugin sockets)
	PodResourcesSocket string // pod_resources_socket ("" = a path that does not exist)
	CDIDir             string // cdi_dir ("" = none)
	// Kubeconfig and NodeName are the manifest's `kubeconfig` and `node_name`, how devhost
	// reaches the API server to publish ResourceSlices and read claims (a DRA resource is not
	// served without them). "" leaves the key out.
	Kubeconfig, NodeName string
	HealthFile           string // the example_c driver's health file (required)
	ReleaseFile          string // the example_c driver's release record ("" = none)
	MetricsAddr          string // metrics_addr, for /status ("" = none)
	StateDir             string // state_dir ("" = devhost's default)
	ClaimCheckInterval   string // dra_claim_check_interval ("" = devhost's default, 5 minutes)
	// GPU serves nvidia.com/gpu (the fake NVML machine of config/sim/nvidia: three H100s,
	// GPUs 0 and 1 on NUMA node 0, GPU 2 on node 1) as DRA driver gpu.nvidia.com.
	GPU bool
	// MIGDevicePlugin also serves nvidia.com/mig-1g.10gb (two MIG devices of GPU 3) through
	// the Device Plugin API: one driver module, both APIs side by side.
	MIGDevicePlugin bool
	// Accel serves example.com/accel (the C example driver: example-0..3, NUMA nodes 0,1,0,1)
	// as DRA driver accel.example.com.
	Accel bool
	// ExampleDevDir is the example_c driver's dev_dir: each device example-<i> is the node
	// <dir>/example<i> ("" = the driver's default, no device nodes).
	ExampleDevDir string
}

// WriteDRAConfig writes a manifest for opts into dir and returns its path. Paths of the
// simulated trees stay relative to the repository root, where Start runs devhost.
func WriteDRAConfig(t testing.TB, dir string, opts DRAOptions) string {
	t.Helper()
	debug := filepath.Join(Root(), "target", "debug")
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	line("driver_dir = %q", debug)
	line("kubelet_dir = %q", opts.KubeletDir)
	podRes := opts.PodResourcesSocket
	if podRes == "" {
		podRes = filepath.Join(dir, "no-pod-resources.sock")
	}
	line("pod_resources_socket = %q", podRes)
	line("pod_resources_interval = \"500ms\"")
	line("runtime_socket = %q", filepath.Join(dir, "no-runtime.sock"))
	// Per test binary (see WriteDemoConfig).
	line("lock_dir = \"/var/lib/devhost-test-lock\"")
	if opts.KubeletRootDir != "" {
		line("kubelet_root_dir = %q", opts.KubeletRootDir)
	}
	if opts.CDIDir != "" {
		line("cdi_dir = %q", opts.CDIDir)
	}
	if opts.Kubeconfig != "" {
		line("kubeconfig = %q", opts.Kubeconfig)
	}
	if opts.NodeName != "" {
		line("node_name = %q", opts.NodeName)
	}
	if opts.MetricsAddr != "" {
		line("metrics_addr = %q", opts.MetricsAddr)
	}
	if opts.StateDir != "" {
		line("state_dir = %q", opts.StateDir)
	}
	if opts.ClaimCheckInterval != "" {
		line("dra_claim_check_interval = %q", opts.ClaimCheckInterval)
	}
	if opts.Accel {
		example := fmt.Sprintf("count = 4, numa_nodes = 2, health_file = %q", opts.HealthFile)
		if opts.ReleaseFile != "" {
			example += fmt.Sprintf(", release_file = %q", opts.ReleaseFile)
		}
		if opts.ExampleDevDir != "" {
			example += fmt.Sprintf(", dev_dir = %q", opts.ExampleDevDir)
		}
		line("\n[driver.example_c]\noptions = { %s }", example)
		line("\n[[resource]]\nname = \"example.com/accel\"\ndriver = \"example_c\"\napi = \"dra\"")
	}
	if opts.GPU || opts.MIGDevicePlugin {
		line(`
[driver.nvidia.options]
nvml_lib = %q
sysfs_root = "config/sim/nvidia/sys"
devfs_root = "config/sim/nvidia/dev"
driver_root = "config/sim/nvidia/driver"
device_list_strategy = ["envvar", "device-nodes"]
recovery_period = "30s"`, filepath.Join(debug, "libfake_nvml.so"))
	}
	if opts.GPU {
		line("\n[[resource]]\nname = \"nvidia.com/gpu\"\ndriver = \"nvidia\"\nmatch = { kind = \"gpu\" }\napi = \"dra\"")
	}
	if opts.MIGDevicePlugin {
		line("\n[[resource]]\nname = \"nvidia.com/mig-1g.10gb\"\ndriver = \"nvidia\"\nmatch = { mig_profile = \"1g.10gb\" }")
	}
	path := filepath.Join(dir, "devhost-dra.toml")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// DRADeviceName is the DRA device name devhost publishes for a driver's device ID
// (host/src/fronts/dra/prepare.rs): the ID itself if it is a DNS label, else lower-cased, every
// other character `-`, trimmed, cut to 54 characters, and `-` plus the ID's FNV-1a hash.
func DRADeviceName(id string) string {
	label := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' }
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }
	ok := len(id) > 0 && len(id) <= 63 && alnum(id[0]) && alnum(id[len(id)-1])
	for i := 0; ok && i < len(id); i++ {
		ok = label(id[i])
	}
	if ok {
		return id
	}
	body := []byte(strings.ToLower(id))
	for i, c := range body {
		if !label(c) {
			body[i] = '-'
		}
	}
	s := strings.Trim(string(body), "-")
	if len(s) > 54 {
		s = s[:54]
	}
	s = strings.TrimRight(s, "-")
	h := uint32(0x811c9dc5)
	for i := 0; i < len(id); i++ {
		h = (h ^ uint32(id[i])) * 0x01000193
	}
	if s == "" {
		return fmt.Sprintf("x-%08x", h)
	}
	return fmt.Sprintf("%s-%08x", s, h)
}

// DRARegisteredLine is what devhost logs when the kubelet's NotifyRegistrationStatus accepts a
// DRA driver (host/src/fronts/dra/registration.rs), with the field dra_driver=<driver>.
const DRARegisteredLine = "the kubelet registered the DRA driver"
