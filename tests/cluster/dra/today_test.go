package dra_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

// devhost serves its DRA resources only as DRA drivers: both sockets per driver in the
// kubelet's folders, where the real plugin watcher picks up the registration socket, and no
// extended resource on the Node; the device-plugin resource of the same NVIDIA module beside
// them is a device plugin as before (capacity on the Node).
func TestDRAResourcesServeOnlyAsDRADriversBesideADevicePlugin(t *testing.T) {
	n := startDRA(t, devhost.DRAOptions{GPU: true, Accel: true, MIGDevicePlugin: true})
	for _, driver := range []string{devhost.GPUDriver, devhost.AccelDriver} {
		reg := filepath.Join("/var/lib/kubelet/plugins_registry", driver+"-reg.sock")
		for _, sock := range []string{reg, filepath.Join("/var/lib/kubelet/plugins", driver, "dra.sock")} {
			devhost.Eventually(t, 30*time.Second, "socket "+sock, func() string {
				if fi, err := os.Stat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
					return fmt.Sprintf("%v (%v); devhost log tail:\n%s", err, fi, n.logTail(15))
				}
				return ""
			})
		}
		devhost.Eventually(t, 30*time.Second, "the kubelet's plugin watcher sees "+reg, func() string {
			if len(cl.KubeletLogLines("Adding socket path", reg)) == 0 {
				return "no kubelet line `Adding socket path ...` for it; kubelet lines naming the driver:\n" +
					strings.Join(kubeletDRALines(driver), "\n")
			}
			return ""
		})
	}
	mig := n.resource(t, "nvidia.com/mig-1g.10gb")
	took := devhost.Eventually(t, 60*time.Second, "the Node shows the device-plugin resource only", func() string {
		nd, err := cl.Node()
		if err != nil {
			return err.Error()
		}
		c, a := nd.Status.Capacity, nd.Status.Allocatable
		if q := c[v1.ResourceName(mig.Resource)]; q.Value() != int64(mig.Healthy+mig.Unhealthy) {
			return fmt.Sprintf("%s capacity %s, devhost lists %d devices", mig.Resource, q.String(), mig.Healthy+mig.Unhealthy)
		}
		if q := a[v1.ResourceName(mig.Resource)]; q.Value() != int64(mig.Healthy) {
			return fmt.Sprintf("%s allocatable %s, devhost lists %d healthy", mig.Resource, q.String(), mig.Healthy)
		}
		for _, res := range []string{"nvidia.com/gpu", "example.com/accel"} {
			if q, ok := c[v1.ResourceName(res)]; ok && !q.IsZero() {
				return fmt.Sprintf("%s (api = \"dra\") has device-plugin capacity %s on the Node", res, q.String())
			}
		}
		return ""
	})
	t.Logf("the Node shows %s (%d devices) and no DRA resource %v after devhost started", mig.Resource, mig.Healthy, took.Round(time.Millisecond))
}

// The control plane the DRA scenarios stand on, without devhost: the resourceclaim controller
// makes a pod's claim from its ResourceClaimTemplate, the scheduler's DynamicResources plugin
// keeps the pod Pending while no ResourceSlice offers a device of the class, and the claim is
// deleted with the pod.
func TestClaimTemplateBecomesAClaimThatNoDeviceCanSatisfy(t *testing.T) {
	needCluster(t)
	createDeviceClass(t, "devhost-test-absent", "absent.example.com")
	createClaimTemplate(t, "absent", resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{
		request("dev", "devhost-test-absent", 1),
	}})
	createClaimPod(t, "wants-absent", []string{"absent"}, nil)
	var claim *resourcev1.ResourceClaim
	var msg string
	devhost.Eventually(t, 60*time.Second, "a claim made from the template, the pod Unschedulable", func() string {
		p := getPod(t, "wants-absent")
		if claim = podClaim(t, p, "absent"); claim == nil {
			return "no claim in pod.status.resourceClaimStatuses\n" + describe("wants-absent", nil)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
				msg = c.Message
				return ""
			}
		}
		return "pod not marked Unschedulable\n" + describe("wants-absent", nil)
	})
	if claim.Annotations["resource.kubernetes.io/pod-claim-name"] != "absent" || len(claim.OwnerReferences) != 1 ||
		claim.OwnerReferences[0].Name != "wants-absent" {
		t.Errorf("claim %s: annotations %v, owners %+v; want pod-claim-name absent, owned by pod wants-absent",
			claim.Name, claim.Annotations, claim.OwnerReferences)
	}
	if claim.Status.Allocation != nil {
		t.Errorf("claim %s allocated with no device published: %s", claim.Name, claimSummary(claim))
	}
	if !strings.Contains(msg, "cannot allocate all claims") {
		t.Errorf("the scheduler's reason is %q, want the DynamicResources plugin's `cannot allocate all claims`", msg)
	}
	t.Logf("claim %s; scheduler: %s", claim.Name, msg)
	deletePod(t, "wants-absent")
	devhost.Eventually(t, 60*time.Second, "the claim deleted with its pod", func() string {
		_, err := cl.Client.ResourceV1().ResourceClaims(ns).Get(ctx(), claim.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return ""
		}
		return fmt.Sprintf("claim %s still there (%v)", claim.Name, err)
	})
}

// The kubeconfig devhost gets verifies the API server by its CA and authenticates as the
// ServiceAccount kube-system/devhost with a token bound to a pod on the node, so the API
// server sees the node's name in it, as for a DaemonSet pod (what a ValidatingAdmissionPolicy
// tying ResourceSlices to their node checks).
func TestDevhostsKubeconfigIsItsServiceAccountOnTheNode(t *testing.T) {
	needCluster(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", cl.DevhostKubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Insecure || len(cfg.CAData) == 0 {
		t.Fatalf("%s: insecure %v, %d bytes of CA: want the API server verified by its CA", cl.DevhostKubeconfig, cfg.Insecure, len(cfg.CAData))
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx(), &authv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("whoami with %s: %v", cl.DevhostKubeconfig, err)
	}
	u := r.Status.UserInfo
	if u.Username != cluster.DevhostUser || !contains(u.Groups, "system:serviceaccounts:kube-system") {
		t.Errorf("devhost is %q in %v, want %s in system:serviceaccounts:kube-system", u.Username, u.Groups, cluster.DevhostUser)
	}
	if got := u.Extra["authentication.kubernetes.io/node-name"]; len(got) != 1 || got[0] != cluster.NodeName {
		t.Errorf("devhost's token names node %v, want %s (extra %v)", got, cluster.NodeName, u.Extra)
	}
	t.Logf("devhost is %s, groups %v, node %v", u.Username, u.Groups, u.Extra["authentication.kubernetes.io/node-name"])
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}
