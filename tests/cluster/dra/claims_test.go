package dra_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
	"devhost.test/cluster/internal/draapi"
)

const ns = "default"

func ctx() context.Context { return context.Background() }

// createDeviceClass makes a DeviceClass selecting every device of driver (a test fixture, for
// drivers deploy/dra/ ships no class for), deleted when the test ends.
func createDeviceClass(t *testing.T, name, driver string) {
	t.Helper()
	dc := &resourcev1.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: resourcev1.DeviceClassSpec{Selectors: []resourcev1.DeviceSelector{{
			CEL: &resourcev1.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", driver)},
		}}},
	}
	if _, err := cl.Client.ResourceV1().DeviceClasses().Create(ctx(), dc, metav1.CreateOptions{}); err != nil {
		t.Fatalf("DeviceClass %s: %v", name, err)
	}
	t.Cleanup(func() { _ = cl.Client.ResourceV1().DeviceClasses().Delete(ctx(), name, metav1.DeleteOptions{}) })
}

func request(name, class string, count int64, cel ...string) resourcev1.DeviceRequest {
	return draapi.Request(name, class, count, cel...)
}

func createClaimTemplate(t *testing.T, name string, devices resourcev1.DeviceClaim) {
	t.Helper()
	draapi.CreateClaimTemplate(t, cl, ns, name, devices)
}

// createClaimPod makes a pod (left to the scheduler: no spec.nodeName) whose one container
// uses a claim made from each template (pod claim name = template name), and asks for the
// extended resources in limits. It is deleted when the test ends.
func createClaimPod(t *testing.T, name string, templates []string, limits map[string]int64) {
	t.Helper()
	rl := cluster.Limits(limits)
	no := false
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			AutomountServiceAccountToken: &no,
			Containers: []v1.Container{{
				Name: "main", Image: "devhost.test/pause:1", ImagePullPolicy: v1.PullIfNotPresent,
				Resources: v1.ResourceRequirements{Limits: rl, Requests: rl},
			}},
		},
	}
	for _, tmpl := range templates {
		tmpl := tmpl
		pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, v1.PodResourceClaim{Name: tmpl, ResourceClaimTemplateName: &tmpl})
		pod.Spec.Containers[0].Resources.Claims = append(pod.Spec.Containers[0].Resources.Claims, v1.ResourceClaim{Name: tmpl})
	}
	if _, err := cl.Client.CoreV1().Pods(ns).Create(ctx(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("pod %s: %v", name, err)
	}
	t.Cleanup(func() { deletePod(t, name) })
}

// deletePod deletes the pod gracefully, as kubectl does (a short grace period), so that it is
// gone from the API server only once the kubelet has stopped it and unprepared its claims; a
// forced delete (grace 0) would leave that to the kubelet after the object is gone, and a test
// that then stopped devhost would leave the kubelet retrying Unprepare for ever.
func deletePod(t *testing.T, name string) {
	grace := int64(1)
	err := cl.Client.CoreV1().Pods(ns).Delete(ctx(), name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("deleting pod %s: %v", name, err)
	}
	devhost.Eventually(t, 90*time.Second, "pod "+name+" gone", func() string {
		_, err := cl.Client.CoreV1().Pods(ns).Get(ctx(), name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return ""
		}
		return fmt.Sprintf("still there (%v)\n%s", err, describe(name, nil))
	})
}

func getPod(t *testing.T, name string) *v1.Pod {
	t.Helper()
	p, err := cl.Client.CoreV1().Pods(ns).Get(ctx(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// podClaim is the ResourceClaim the resourceclaim controller made for the pod's claim
// podClaimName (from pod.status.resourceClaimStatuses), or nil while there is none.
func podClaim(t *testing.T, pod *v1.Pod, podClaimName string) *resourcev1.ResourceClaim {
	t.Helper()
	for _, s := range pod.Status.ResourceClaimStatuses {
		if s.Name == podClaimName && s.ResourceClaimName != nil {
			c, err := cl.Client.ResourceV1().ResourceClaims(ns).Get(ctx(), *s.ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatalf("claim %s of pod %s: %v", *s.ResourceClaimName, pod.Name, err)
			}
			return c
		}
	}
	return nil
}

// describe is what a reader of a failure needs about a pod: phase, conditions, claim
// statuses, the namespace's claims (allocation, reservedFor), the pod's events, the published
// ResourceSlices, and (with n) the devhost log tail.
func describe(pod string, n *node) string {
	var b strings.Builder
	if p, err := cl.Client.CoreV1().Pods(ns).Get(ctx(), pod, metav1.GetOptions{}); err != nil {
		fmt.Fprintf(&b, "pod %s: %v\n", pod, err)
	} else {
		fmt.Fprintf(&b, "pod %s: phase %q node %q reason %q message %q\n", pod, p.Status.Phase, p.Spec.NodeName, p.Status.Reason, p.Status.Message)
		for _, c := range p.Status.Conditions {
			fmt.Fprintf(&b, "  condition %s=%s %s: %s\n", c.Type, c.Status, c.Reason, c.Message)
		}
		for _, s := range p.Status.ResourceClaimStatuses {
			fmt.Fprintf(&b, "  resourceClaimStatus %s -> %v\n", s.Name, ptrString(s.ResourceClaimName))
		}
		if e := p.Status.ExtendedResourceClaimStatus; e != nil {
			fmt.Fprintf(&b, "  extendedResourceClaimStatus claim %s mappings %+v\n", e.ResourceClaimName, e.RequestMappings)
		}
	}
	if claims, err := cl.Client.ResourceV1().ResourceClaims(ns).List(ctx(), metav1.ListOptions{}); err == nil {
		for _, c := range claims.Items {
			fmt.Fprintf(&b, "claim %s: %s\n", c.Name, claimSummary(&c))
		}
	}
	if ev, err := cl.Client.CoreV1().Events(ns).List(ctx(), metav1.ListOptions{FieldSelector: "involvedObject.name=" + pod}); err == nil {
		for _, e := range ev.Items {
			fmt.Fprintf(&b, "event %s %s (%s, x%d): %s\n", e.Type, e.Reason, e.Source.Component, e.Count, e.Message)
		}
	}
	b.WriteString(slicesSummary(""))
	if n != nil {
		fmt.Fprintf(&b, "devhost log tail:\n%s\n", n.logTail(25))
	}
	return b.String()
}

func ptrString(s *string) string {
	if s == nil {
		return "<none>"
	}
	return *s
}

func claimSummary(c *resourcev1.ResourceClaim) string { return draapi.ClaimSummary(c) }

func slicesSummary(driver string) string { return draapi.SlicesSummary(cl, driver) }

func attrString(a resourcev1.DeviceAttribute) string { return draapi.AttrString(a) }
