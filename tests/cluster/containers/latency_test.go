package containers_test

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"devhost.test/cluster/internal/devhost"
)

// startLatency creates a pod asking for limits and returns the time from just before its
// creation until the API server shows its container running (a watch, not polling).
func startLatency(t *testing.T, name string, limits map[string]int64) time.Duration {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	w, err := cl.Client.CoreV1().Pods("default").Watch(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	start := time.Now()
	shellPod(t, name, "", limits)
	for ev := range w.ResultChan() {
		p, ok := ev.Object.(*v1.Pod)
		if !ok {
			continue
		}
		if s := p.Status.ContainerStatuses; len(s) == 1 && s[0].State.Running != nil {
			return time.Since(start)
		}
	}
	t.Fatalf("pod %s: no running container within 90 s", name)
	return 0
}

func median(d []time.Duration) time.Duration {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d[len(d)/2]
}

// TestPodStartLatencyWithAndWithoutADevice records devhost's share of a pod's start on a real
// runtime: pods are created one at a time, alternating one asking for an example.com/accel
// device and one asking for nothing, on the same node in the same run, each timed from its
// creation until its container runs. It asserts only that every pod starts; the figures go to
// docs/benchmarks.md ("Pod start with a real runtime").
func TestPodStartLatencyWithAndWithoutADevice(t *testing.T) {
	startDevhost(t, devhost.Options{})
	const rounds = 5
	var with, without []time.Duration
	for i := range rounds {
		without = append(without, startLatency(t, fmt.Sprintf("lat-none-%d", i), nil))
		with = append(with, startLatency(t, fmt.Sprintf("lat-dev-%d", i), map[string]int64{"example.com/accel": 1}))
		deletePod(t, fmt.Sprintf("lat-none-%d", i))
		deletePod(t, fmt.Sprintf("lat-dev-%d", i))
	}
	mw, mo := median(with), median(without)
	t.Logf("creation → container running, %d pods each, median (min–max): with a device %v (%v–%v), without %v (%v–%v); devhost's share %v",
		rounds, mw.Round(time.Millisecond), with[0].Round(time.Millisecond), with[rounds-1].Round(time.Millisecond),
		mo.Round(time.Millisecond), without[0].Round(time.Millisecond), without[rounds-1].Round(time.Millisecond),
		(mw - mo).Round(time.Millisecond))
}
