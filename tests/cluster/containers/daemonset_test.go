package containers_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

// imageArchive is the image .ci/image builds from deploy/Dockerfile, as `docker save` wrote it:
// $DEVHOST_IMAGE_ARCHIVE, else target/ci-image/devhost-image.tar.
func imageArchive(t *testing.T) string {
	t.Helper()
	path := os.Getenv("DEVHOST_IMAGE_ARCHIVE")
	if path == "" {
		path = filepath.Join(devhost.Root(), "target", "ci-image", "devhost-image.tar")
	}
	if _, err := os.Stat(path); err != nil {
		why := fmt.Sprintf("no devhost image archive at %s (run .ci/image first, which saves it there): %v", path, err)
		if os.Getenv("CI") == "true" {
			t.Fatal(why)
		}
		t.Skip(why)
	}
	return path
}

// releaseRecord is where the C example driver in the DaemonSet's pod records its releases: under
// the pod's state_dir mount, /var/lib/devhost, the same folder on the node.
const releaseRecord = "/var/lib/devhost/released"

// daemonSetManifest is the DaemonSet's devhost.toml for the simulated node: every bundled
// driver on the trees under config/sim (the DaemonSet gets them as one more read-only hostPath),
// the C example handing out real device nodes and recording its releases, CDI specs where
// containerd reads them.
func daemonSetManifest(sim, nodes string) string {
	return fmt.Sprintf(`metrics_addr = "0.0.0.0:9400"
cdi_dir = "/var/run/cdi"

[driver.example_c]
options = { count = 4, numa_nodes = 2, dev_dir = %[2]q, release_file = %[3]q }

[[resource]]
name = "example.com/accel"
driver = "example_c"

[driver.fpga.options]
sysfs_root = "%[1]s/fpga/sys"
devfs_root = "%[1]s/fpga/dev"

[[resource]]
name = "example.com/fpga-nlb0"
driver = "fpga"
match = { driver = "dfl", afu_id = "d8424dc4a4a3c413f89e433683f9040b" }

[driver.tpu.options]
sysfs_root = "%[1]s/tpu/sys"
devfs_root = "%[1]s/tpu/dev"
allocation = "boxes"

[[resource]]
name = "google.com/tpu"
driver = "tpu"

[driver.nvidia.options]
nvml_lib = "/opt/fake-nvml/libfake_nvml.so"
sysfs_root = "%[1]s/nvidia/sys"
devfs_root = "%[1]s/nvidia/dev"
driver_root = "%[1]s/nvidia/driver"

[[resource]]
name = "nvidia.com/gpu"
driver = "nvidia"
match = { kind = "gpu" }
`, sim, nodes, releaseRecord)
}

// daemonSetResources is what the Node must show once the DaemonSet's pod serves the manifest.
var daemonSetResources = map[string]int64{
	"example.com/accel": 4, "example.com/fpga-nlb0": 1, "google.com/tpu": 8, "nvidia.com/gpu": 3,
}

// renderDeploy is `kubectl kustomize deploy/` (what operators apply), decoded.
func renderDeploy(t *testing.T) []runtime.Object {
	t.Helper()
	out, err := cl.Kubectl("kustomize", filepath.Join(devhost.Root(), "deploy"))
	if err != nil {
		t.Fatal(err)
	}
	return decodeRender(t, "the kustomize render", out)
}

// helmBinary is the helm deploy/helm/check.sh builds and caches (CI runs it before these
// tests): $DEVHOST_HELM_CACHE (else ~/.cache/devhost-helm)/<version>/helm, the version
// check.sh's HELM_VERSION (its default, unless set here too).
func helmBinary(t *testing.T) string {
	t.Helper()
	version := os.Getenv("HELM_VERSION")
	if version == "" {
		script, err := os.ReadFile(filepath.Join(devhost.Root(), "deploy", "helm", "check.sh"))
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`HELM_VERSION=\$\{HELM_VERSION:-(v[0-9.]+)\}`).FindSubmatch(script)
		if m == nil {
			t.Fatal("deploy/helm/check.sh no longer sets HELM_VERSION=${HELM_VERSION:-v…}: update this test")
		}
		version = string(m[1])
	}
	cache := os.Getenv("DEVHOST_HELM_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "devhost-helm")
	}
	helm := filepath.Join(cache, version, "helm")
	if _, err := os.Stat(helm); err != nil {
		why := fmt.Sprintf("no helm %s at %s (deploy/helm/check.sh builds it there): %v", version, helm, err)
		if os.Getenv("CI") == "true" {
			t.Fatal(why)
		}
		t.Skip(why)
	}
	return helm
}

// renderHelm is `helm template devhost deploy/helm/devhost --namespace kube-system` with the
// chart's default values (what `helm install` would create), decoded.
func renderHelm(t *testing.T) []runtime.Object {
	t.Helper()
	cmd := exec.Command(helmBinary(t), "template", "devhost", filepath.Join(devhost.Root(), "deploy", "helm", "devhost"),
		"--namespace", "kube-system")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm template: %v: %s", err, stderr.String())
	}
	return decodeRender(t, "the Helm render", out)
}

// decodeRender decodes a multi-document YAML render into API objects.
func decodeRender(t *testing.T, what string, out []byte) []runtime.Object {
	t.Helper()
	var objs []runtime.Object
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		var raw runtime.RawExtension
		if err := dec.Decode(&raw); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if len(bytes.TrimSpace(raw.Raw)) == 0 || string(bytes.TrimSpace(raw.Raw)) == "null" {
			continue
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(raw.Raw, nil, nil)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		objs = append(objs, obj)
	}
	return objs
}

// addFixtures gives the DaemonSet's pod what simulates the node's hardware, and nothing else:
// config/sim at its own path and the fake libnvidia-ml where the manifest names it, both
// read-only hostPaths, and the fake's machine file. The runtime volume (the node's
// /run/containerd) is the test containerd's socket folder. Its securityContext, mounts and
// probes stay as rendered, so a missing mount or privilege is a failure here.
func addFixtures(t *testing.T, ds *appsv1.DaemonSet, sim, nvml string) {
	spec := &ds.Spec.Template.Spec
	runtimeVolume := false
	for i := range spec.Volumes {
		if v := &spec.Volumes[i]; v.Name == "runtime" && v.HostPath != nil && v.HostPath.Path == "/run/containerd" {
			v.HostPath.Path = filepath.Dir(cl.Containerd.Socket)
			runtimeVolume = true
		}
	}
	if !runtimeVolume {
		t.Fatal("deploy/ no longer mounts the node's /run/containerd as the volume \"runtime\": update this test")
	}
	file, dir := v1.HostPathFile, v1.HostPathDirectory
	spec.Volumes = append(spec.Volumes,
		v1.Volume{Name: "test-sim", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: sim, Type: &dir}}},
		v1.Volume{Name: "test-fake-nvml", VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: nvml, Type: &file}}})
	c := &spec.Containers[0]
	c.VolumeMounts = append(c.VolumeMounts,
		v1.VolumeMount{Name: "test-sim", MountPath: sim, ReadOnly: true},
		v1.VolumeMount{Name: "test-fake-nvml", MountPath: "/opt/fake-nvml/libfake_nvml.so", ReadOnly: true})
	c.Env = append(c.Env, v1.EnvVar{Name: "FAKE_NVML_MACHINE", Value: filepath.Join(sim, "nvidia", "machine.toml")})
}

// deployDevhost imports the image, creates the objects of a render of deploy/ (renderDeploy,
// renderHelm) with the test's manifest and fixtures, labels the node for the DaemonSet's
// affinity, and returns the DaemonSet as created.
func deployDevhost(t *testing.T, nodes string, objs []runtime.Object) *appsv1.DaemonSet {
	t.Helper()
	archive := imageArchive(t)
	// The node's devhost state (the DaemonSet's state_dir hostPath) starts empty: an earlier
	// test's DaemonSet may have left a release pending there, which this pod would then finish
	// (logging the device's release as a WARN).
	state := filepath.Dir(releaseRecord)
	if err := os.RemoveAll(state); err != nil {
		t.Fatal(err)
	}
	if err := cl.Containerd.ImportArchive(archive); err != nil {
		t.Fatal(err)
	}
	sim := filepath.Join(devhost.Root(), "config", "sim")
	nvml := filepath.Join(devhost.Root(), "target", "debug", "libfake_nvml.so")
	ctx := context.Background()
	var ds *appsv1.DaemonSet
	var configMap, serviceAccount *metav1.ObjectMeta
	for _, obj := range objs {
		var err error
		switch o := obj.(type) {
		case *v1.ConfigMap:
			o.Data["devhost.toml"] = daemonSetManifest(sim, nodes)
			_, err = cl.Client.CoreV1().ConfigMaps(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
			configMap = &o.ObjectMeta
		case *v1.ServiceAccount:
			serviceAccount, err = createServiceAccount(t, o)
		case *appsv1.DaemonSet:
			addFixtures(t, o, sim, nvml)
			// The image the render names is the one .ci/image built, under the name deploy/ gives it.
			if _, err := cl.Containerd.Ctr("images", "tag", "--force", "docker.io/library/devhost:ci", o.Spec.Template.Spec.Containers[0].Image); err != nil {
				t.Fatal(err)
			}
			ds, err = cl.Client.AppsV1().DaemonSets(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		default:
			t.Fatalf("deploy/ renders a %T this test does not know", obj)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if ds == nil {
		t.Fatal("deploy/ renders no DaemonSet")
	}
	t.Cleanup(func() {
		bg := metav1.DeletePropagationForeground
		_ = cl.Client.AppsV1().DaemonSets(ds.Namespace).Delete(ctx, ds.Name, metav1.DeleteOptions{PropagationPolicy: &bg})
		if configMap != nil {
			_ = cl.Client.CoreV1().ConfigMaps(configMap.Namespace).Delete(ctx, configMap.Name, metav1.DeleteOptions{})
		}
		if serviceAccount != nil {
			_ = cl.Client.CoreV1().ServiceAccounts(serviceAccount.Namespace).Delete(ctx, serviceAccount.Name, metav1.DeleteOptions{})
		}
	})
	patch := []byte(`{"metadata":{"labels":{"devhost/enabled":"true"}}}`)
	if _, err := cl.Client.CoreV1().Nodes().Patch(ctx, cluster.NodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	return ds
}

// createServiceAccount creates the render's ServiceAccount and returns it for the test's
// cleanup; if the harness made kube-system/devhost already (devhost's DRA identity, whose
// token other tests use: deleting the account would revoke it), it updates that one to the
// render's labels, annotations and token mount instead, and returns nil: it stays.
func createServiceAccount(t *testing.T, sa *v1.ServiceAccount) (*metav1.ObjectMeta, error) {
	t.Helper()
	ctx := context.Background()
	_, err := cl.Client.CoreV1().ServiceAccounts(sa.Namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err == nil {
		return &sa.ObjectMeta, nil
	}
	if !apierrors.IsAlreadyExists(err) {
		return nil, err
	}
	old, err := cl.Client.CoreV1().ServiceAccounts(sa.Namespace).Get(ctx, sa.Name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	old.Labels, old.Annotations, old.AutomountServiceAccountToken = sa.Labels, sa.Annotations, sa.AutomountServiceAccountToken
	_, err = cl.Client.CoreV1().ServiceAccounts(sa.Namespace).Update(ctx, old, metav1.UpdateOptions{})
	return nil, err
}

// devhostPod waits until the DaemonSet's pod on the node is Running and Ready (its readiness
// probe is devhost's /readyz on the pod's address), and runs image if that is not "", and
// returns it.
func devhostPod(t *testing.T, ds *appsv1.DaemonSet, timeout time.Duration, image string) *v1.Pod {
	t.Helper()
	var pod *v1.Pod
	devhost.Eventually(t, timeout, "the DaemonSet's pod Running and Ready", func() string {
		pods, err := cl.Client.CoreV1().Pods(ds.Namespace).List(context.Background(),
			metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=devhost"})
		if err != nil {
			return err.Error()
		}
		if len(pods.Items) != 1 {
			return fmt.Sprintf("%d pods", len(pods.Items))
		}
		pod = &pods.Items[0]
		if image != "" && pod.Spec.Containers[0].Image != image {
			return fmt.Sprintf("pod %s runs %s", pod.Name, pod.Spec.Containers[0].Image)
		}
		for _, c := range pod.Status.Conditions {
			if c.Type == v1.PodReady && c.Status == v1.ConditionTrue {
				return ""
			}
		}
		return fmt.Sprintf("pod %s phase %s; %s", pod.Name, pod.Status.Phase, waitingReasons(pod))
	})
	return pod
}

// TestDevhostAsTheDaemonSetsPod: the image .ci/image builds runs as the pod of the DaemonSet
// from deploy/ (kustomize), created through the API server, scheduled and started by the real
// kubelet on containerd with the rendered securityContext (read-only root, every capability
// dropped, RuntimeDefault seccomp) and mounts; then it is upgraded under running containers.
func TestDevhostAsTheDaemonSetsPod(t *testing.T) {
	needCluster(t)
	nodes := "/var/lib/devhost-test-nodes"
	makeExampleNodes(t, nodes)
	start := time.Now()
	ds := deployDevhost(t, nodes, renderDeploy(t))
	pod := devhostPod(t, ds, 120*time.Second, "")
	ready := time.Since(start)
	waitDaemonSetResources(t)
	t.Logf("DaemonSet created → its pod Ready in %v, every resource allocatable after %v", ready.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	t.Run("serves the node and a container gets its device", func(t *testing.T) { servesTheNode(t, pod) })
	t.Run("rolling upgrade under running containers", func(t *testing.T) { rollingUpgrade(t, ds) })
}

// TestDevhostAsTheHelmChartsDaemonSetsPod: the same image as the pod of the DaemonSet the Helm
// chart renders with its default values (`helm template`, the real helm), created through the
// API server and started by the kubelet on containerd with the chart's securityContext, mounts
// and probes: Ready, every resource on the Node, its CDI specs on the node, a container gets
// its device, and devhost logged no warning. (The rolling upgrade runs on the kustomize render
// only: the chart's updateStrategy is the same, which deploy/helm/check.sh compares.)
func TestDevhostAsTheHelmChartsDaemonSetsPod(t *testing.T) {
	needCluster(t)
	nodes := "/var/lib/devhost-test-nodes"
	makeExampleNodes(t, nodes)
	objs := renderHelm(t)
	start := time.Now()
	ds := deployDevhost(t, nodes, objs)
	pod := devhostPod(t, ds, 120*time.Second, "")
	ready := time.Since(start)
	waitDaemonSetResources(t)
	t.Logf("the chart's DaemonSet created → its pod Ready in %v, every resource allocatable after %v",
		ready.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	servesTheNode(t, pod)
}

// waitDaemonSetResources waits until the Node's allocatable is daemonSetResources.
func waitDaemonSetResources(t *testing.T) {
	t.Helper()
	devhost.Eventually(t, 60*time.Second, "the Node shows the DaemonSet's resources", func() string {
		nd, err := cl.Node()
		if err != nil {
			return err.Error()
		}
		for res, n := range daemonSetResources {
			q := nd.Status.Allocatable[v1.ResourceName(res)]
			if q.Value() != n {
				return fmt.Sprintf("%s: allocatable %d, want %d", res, q.Value(), n)
			}
		}
		return ""
	})
}

// servesTheNode: the pod's CDI specs land in the host's /var/run/cdi, a pod asking for
// example.com/accel gets its device node in its container, and devhost logged no warning.
func servesTheNode(t *testing.T, pod *v1.Pod) {
	specs, _ := filepath.Glob("/var/run/cdi/devhost-*.json")
	if len(specs) == 0 {
		t.Errorf("the DaemonSet's pod wrote no CDI spec into the host's /var/run/cdi")
	}
	user := shellPod(t, "accel-user", probeDevices, map[string]int64{"example.com/accel": 1})
	out := strings.Join(containerOutput(t, user, 90*time.Second), "\n")
	ids := heldIDs(t, user.Name)
	if len(ids) != 1 {
		t.Fatalf("PodResources: accel-user holds %v", ids)
	}
	i := exampleIndex(t, ids[0])
	for _, w := range []string{
		fmt.Sprintf("node /dev/example%d character special file %x:%x", i, exampleNodes[i].major, exampleNodes[i].minor),
		fmt.Sprintf("open /dev/example%d ok", i),
		"env EXAMPLE_VISIBLE_DEVICES=" + ids[0], // one device: no order to differ
	} {
		if !strings.Contains(out, w) {
			t.Errorf("accel-user's container lacks %q:\n%s", w, out)
		}
	}
	for _, l := range strings.Split(podLog(t, pod, "devhost"), "\n") {
		if strings.Contains(l, `"level":"WARN"`) || strings.Contains(l, `"level":"ERROR"`) {
			t.Errorf("the DaemonSet's devhost logged: %s", l)
		}
	}
}

// heldIDs are the example.com/accel devices PodResources lists for a pod, sorted.
func heldIDs(t *testing.T, pod string) []string {
	t.Helper()
	devs, err := cluster.PodDevices("default", pod)
	if err != nil {
		t.Fatal(err)
	}
	ids := devs["example.com/accel"]
	sort.Strings(ids)
	return ids
}

func exampleIndex(t *testing.T, id string) int {
	t.Helper()
	var i int
	if _, err := fmt.Sscanf(id, "example-%d", &i); err != nil || i >= len(exampleNodes) {
		t.Fatalf("unexpected device ID %q", id)
	}
	return i
}

// podLog is a container's log as the kubelet keeps it (the text of each line).
func podLog(t *testing.T, pod *v1.Pod, container string) string {
	t.Helper()
	files, _ := filepath.Glob(fmt.Sprintf("/var/log/pods/%s_%s_%s/%s/*.log", pod.Namespace, pod.Name, pod.UID, container))
	var b strings.Builder
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(data), "\n") {
			if f := strings.SplitN(l, " ", 4); len(f) == 4 {
				b.WriteString(f[3] + "\n")
			}
		}
	}
	return b.String()
}
