// Vendor parameters (ABI 1.3) with the real scheduler and kubelet: a ResourceClaimTemplate's
// opaque config for gpu.nvidia.com, copied into the allocation by the scheduler, reaches the
// NVIDIA driver's allocate hook, which turns MPS settings into the container's environment
// (through the claim's CDI spec); settings it refuses fail the claim's NodePrepareResources
// with its message, which the kubelet reports on the pod.
package dra_test

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"devhost.test/cluster/internal/devhost"
)

// gpuClaimWith is one GPU of gpu.nvidia.com with `parameters` as the claim's opaque config.
func gpuClaimWith(parameters string) resourcev1.DeviceClaim {
	return resourcev1.DeviceClaim{
		Requests: []resourcev1.DeviceRequest{request("gpu", devhost.GPUDriver, 1)},
		Config: []resourcev1.DeviceClaimConfiguration{{
			DeviceConfiguration: resourcev1.DeviceConfiguration{Opaque: &resourcev1.OpaqueDeviceConfiguration{
				Driver:     devhost.GPUDriver,
				Parameters: runtime.RawExtension{Raw: []byte(parameters)},
			}},
		}},
	}
}

func TestClaimsMPSSettingsReachTheContainerAndRefusedOnesFailItsPrepare(t *testing.T) {
	n := startPublishing(t, devhost.DRAOptions{GPU: true})
	ensureDeviceClass(t, devhost.GPUDriver)
	createClaimTemplate(t, "mps-gpu", gpuClaimWith(
		`{"sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50, "pinnedMemoryLimit": "10Gi"}}}`))
	createClaimPod(t, "mps-pod", []string{"mps-gpu"}, nil)
	n.waitPodRunning(t, "mps-pod", 120*time.Second)
	rec := cl.CRIRecord(t, ns, "mps-pod")
	env := n.cdiEnv(t, rec.CDIDevices)
	for _, want := range []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M"} {
		if !contains(env, want) {
			t.Errorf("the container's CDI devices %v give env %v, without %s", rec.CDIDevices, env, want)
		}
	}

	createClaimTemplate(t, "sliced-gpu", gpuClaimWith(`{"sharing": {"strategy": "TimeSlicing"}}`))
	createClaimPod(t, "sliced-pod", []string{"sliced-gpu"}, nil)
	devhost.Eventually(t, 90*time.Second, "the kubelet reports devhost's refusal on sliced-pod", func() string {
		list, err := cl.Client.CoreV1().Events(ns).List(ctx(), metav1.ListOptions{FieldSelector: "involvedObject.name=sliced-pod"})
		if err != nil {
			return err.Error()
		}
		var seen []string
		for _, e := range list.Items {
			if strings.Contains(e.Message, "TimeSlicing is not a claim's to set") && strings.Contains(e.Message, "sliced-pod-sliced-gpu") {
				t.Logf("%s: %s", e.Reason, e.Message)
				return ""
			}
			seen = append(seen, e.Reason+": "+e.Message)
		}
		return fmt.Sprintf("events so far: %v\n%s", seen, describe("sliced-pod", n))
	})
	if p := getPod(t, "sliced-pod"); p.Status.Phase == "Running" {
		t.Fatalf("sliced-pod runs although its claim was refused")
	}
}

// cdiEnv is every environment entry the CDI devices `names` give a container, from the specs
// in the test's CDI folder (the device's own and its spec's).
func (n *node) cdiEnv(t *testing.T, names []string) []string {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(n.opts.CDIDir, "*.json"))
	var env []string
	for _, f := range files {
		s, err := cdi.ReadSpec(f, 0)
		if err != nil {
			t.Fatalf("the CDI library refuses %s: %v", f, err)
		}
		for _, d := range s.Devices {
			if contains(names, s.Kind+"="+d.Name) {
				env = append(env, d.ContainerEdits.Env...)
				env = append(env, s.ContainerEdits.Env...)
			}
		}
	}
	return env
}
