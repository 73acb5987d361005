package cluster

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	podresources "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// Node reads the Node object.
func (c *Cluster) Node() (*v1.Node, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
}

// WaitNodeReady waits until the Node exists with condition Ready=True.
func (c *Cluster) WaitNodeReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	last := "not registered"
	for time.Now().Before(deadline) {
		if c.kubelet.Exited() {
			return fmt.Errorf("the kubelet exited")
		}
		if n, err := c.Node(); err == nil {
			last = "no Ready condition"
			for _, cond := range n.Status.Conditions {
				if cond.Type == v1.NodeReady {
					if cond.Status == v1.ConditionTrue {
						return nil
					}
					last = fmt.Sprintf("Ready=%s: %s", cond.Status, cond.Message)
				}
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	return fmt.Errorf("node %s not Ready within %v: %s", NodeName, timeout, last)
}

// PodDevices lists, through the kubelet's PodResources API, the device IDs per resource that
// the kubelet holds for a pod's containers (all containers together).
func PodDevices(namespace, pod string) (map[string][]string, error) {
	containers, err := podContainers(namespace, pod)
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, ctr := range containers {
		for _, d := range ctr.Devices {
			out[d.ResourceName] = append(out[d.ResourceName], d.DeviceIds...)
		}
	}
	return out, nil
}

// ClaimDevice is one device of a DRA claim as the kubelet's PodResources API lists it for a
// container: the claim, the device's driver, pool and name, and the CDI device names the
// driver's NodePrepareResources answered.
type ClaimDevice struct {
	Claim, Driver, Pool, Device string
	CDIDevices                  []string
}

// PodClaimDevices lists, through the kubelet's PodResources API (dynamic_resources), the DRA
// devices the kubelet holds for a pod's containers (all containers together).
func PodClaimDevices(namespace, pod string) ([]ClaimDevice, error) {
	containers, err := podContainers(namespace, pod)
	if err != nil {
		return nil, err
	}
	var out []ClaimDevice
	for _, ctr := range containers {
		for _, dr := range ctr.DynamicResources {
			for _, r := range dr.ClaimResources {
				d := ClaimDevice{Claim: dr.ClaimName, Driver: r.DriverName, Pool: r.PoolName, Device: r.DeviceName}
				for _, c := range r.CdiDevices {
					d.CDIDevices = append(d.CDIDevices, c.Name)
				}
				out = append(out, d)
			}
		}
	}
	return out, nil
}

// podContainers is the pod's containers in the kubelet's PodResources List.
func podContainers(namespace, pod string) ([]*podresources.ContainerResources, error) {
	conn, err := grpc.NewClient("unix://"+PodResourcesSocket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := podresources.NewPodResourcesListerClient(conn).List(ctx, &podresources.ListPodResourcesRequest{})
	if err != nil {
		return nil, fmt.Errorf("PodResources List: %w", err)
	}
	var out []*podresources.ContainerResources
	for _, p := range resp.PodResources {
		if p.Namespace == namespace && p.Name == pod {
			out = append(out, p.Containers...)
		}
	}
	return out, nil
}

// Pod reads pod default/name, failing the test if it cannot.
func (c *Cluster) Pod(t testing.TB, name string) *v1.Pod {
	t.Helper()
	p, err := c.Client.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// DeletePod deletes pod default/name with grace (nil: the pod's own grace period) and waits up
// to 60 s until the API server no longer has it.
func (c *Cluster) DeletePod(t testing.TB, name string, grace *int64) {
	ctx := context.Background()
	err := c.Client.CoreV1().Pods("default").Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: grace})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("deleting pod %s: %v", name, err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		_, err := c.Client.CoreV1().Pods("default").Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s still there 60 s after its deletion (%v)", name, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
