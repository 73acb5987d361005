package containers_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

// releaseGrace is the stubborn pods' termination grace period: their container ignores SIGTERM,
// so it runs until the kubelet's SIGKILL at the end of it.
const releaseGrace = 6

// stubborn ignores SIGTERM (PID 1 has no default action for it anyway) and touches /beat/beat
// every 100 ms, so the file's mtime says when the container last ran.
const stubborn = "trap '' TERM\nwhile :; do : > /beat/beat; sleep 0.1; done\n"

// TestReleaseHookRunsOnlyAfterTheContainerHasExited: a pod holding an example.com/accel device
// whose container ignores SIGTERM for its grace period goes away three ways: deleted gracefully
// through the API, force-deleted, and as a static pod whose manifest is removed. The kubelet
// stops listing the last two in PodResources at once, while their container still runs; devhost
// asks containerd (runtime_socket) and runs the driver's release hook only after the container's
// last sign of life, exactly once for its device. (Before, the static pod's device was released
// about 2 s after its manifest went, while the container ran for its whole grace period.)
func TestReleaseHookRunsOnlyAfterTheContainerHasExited(t *testing.T) {
	n := startDevhost(t, devhost.Options{RuntimeSocket: cl.Containerd.Socket})
	release := filepath.Join(filepath.Dir(n.config), "released")
	for _, way := range []struct {
		name string
		// start runs the pod with beat mounted at /beat and returns its name as PodResources
		// lists it, and what removes it.
		start func(t *testing.T, name, beat string) (string, func())
		// waits: whether the kubelet drops the pod from PodResources before its container has
		// exited, so devhost must say it waits for the runtime.
		waits bool
	}{
		{"graceful", apiStubborn(nil), false},
		{"force", apiStubborn(new(int64)), true},
		{"static", staticStubborn, true},
	} {
		t.Run(way.name, func(t *testing.T) {
			beat := t.TempDir()
			pod, remove := way.start(t, "stubborn-"+way.name, beat)
			devhost.Eventually(t, 60*time.Second, "the container beats", func() string {
				if st, err := os.Stat(filepath.Join(beat, "beat")); err != nil || time.Since(st.ModTime()) > time.Second {
					return fmt.Sprintf("no fresh beat: %v", err)
				}
				return ""
			})
			var id string
			devhost.Eventually(t, 20*time.Second, pod+" listed with its device", func() string {
				devs, err := cluster.PodDevices("default", pod)
				if err != nil || len(devs["example.com/accel"]) != 1 {
					return fmt.Sprintf("%v %v", devs, err)
				}
				id = devs["example.com/accel"][0]
				return ""
			})
			before := releasesOf(release, id)
			removed := time.Now()
			remove()
			released := time.Now()
			devhost.Eventually(t, (releaseGrace+30)*time.Second, "the release of "+id, func() string {
				released = time.Now()
				if got := releasesOf(release, id); got != before+1 {
					return fmt.Sprintf("%d release(s) of %s, want %d", got, id, before+1)
				}
				return ""
			})
			// The container's end: its last beat, once it has stopped beating for a second.
			var lastBeat time.Time
			devhost.Eventually(t, (releaseGrace+10)*time.Second, "the container to stop", func() string {
				st, err := os.Stat(filepath.Join(beat, "beat"))
				if err != nil {
					return err.Error()
				}
				if lastBeat = st.ModTime(); time.Since(lastBeat) < time.Second {
					return "still beating"
				}
				return ""
			})
			ran, after := lastBeat.Sub(removed), released.Sub(lastBeat)
			t.Logf("%s: the container ran %v after the removal; %s released %v after its last beat", way.name, ran, id, after)
			if !released.After(lastBeat) {
				t.Errorf("%s released %v before the container's last beat", id, -after)
			}
			if way.name != "force" && ran < (releaseGrace-2)*time.Second {
				t.Errorf("the container ran only %v of its %d s grace period: the scenario tests nothing", ran, releaseGrace)
			}
			if got := releasesOf(release, id); got != before+1 {
				t.Errorf("%d release(s) of %s, want exactly %d", got, id, before+1)
			}
			logged := strings.Contains(readFile(n.dh.Log), "not releasing "+id+" yet: waiting for default/"+pod+"/main to exit")
			if way.waits && !logged {
				t.Errorf("devhost did not say it waited for %s's container", pod)
			}
			t.Logf("%s: devhost waited for the runtime: %v", way.name, logged)
		})
	}
}

// apiStubborn makes the stubborn pod through the API; removing it deletes it with grace (nil:
// the pod's own).
func apiStubborn(grace *int64) func(t *testing.T, name, beat string) (string, func()) {
	return func(t *testing.T, name, beat string) (string, func()) {
		scriptPod(t, name, stubborn, map[string]int64{"example.com/accel": 1}, withBeat(beat))
		return name, func() {
			err := cl.Client.CoreV1().Pods("default").Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: grace})
			if err != nil {
				t.Fatal(err)
			}
		}
	}
}

// staticStubborn runs the stubborn pod as a static pod (a manifest in the kubelet's
// staticPodPath); removing it removes the file. The kubelet names it <name>-<node>.
func staticStubborn(t *testing.T, name, beat string) (string, func()) {
	rl := cluster.Limits(map[string]int64{"example.com/accel": 1})
	pod := &v1.Pod{
		TypeMeta:   metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: v1.PodSpec{
			RestartPolicy: v1.RestartPolicyNever,
			DNSPolicy:     v1.DNSDefault,
			Containers: []v1.Container{{
				Name: "main", Image: cluster.BusyboxImage, ImagePullPolicy: v1.PullNever,
				Command:   []string{"/bin/sh", "-c", stubborn},
				Resources: v1.ResourceRequirements{Limits: rl, Requests: rl},
			}},
		},
	}
	withBeat(beat)(pod)
	data, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(cl.StaticPodDir, name+".json")
	if err := os.WriteFile(file, data, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(file) })
	return name + "-" + cluster.NodeName, func() {
		if err := os.Remove(file); err != nil {
			t.Fatal(err)
		}
	}
}

// withBeat mounts the host folder beat at /beat and sets the grace period to releaseGrace.
func withBeat(beat string) func(*v1.Pod) {
	return func(p *v1.Pod) {
		grace := int64(releaseGrace)
		p.Spec.TerminationGracePeriodSeconds = &grace
		dir := v1.HostPathDirectory
		p.Spec.Volumes = append(p.Spec.Volumes, v1.Volume{Name: "beat",
			VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: beat, Type: &dir}}})
		c := &p.Spec.Containers[0]
		c.VolumeMounts = append(c.VolumeMounts, v1.VolumeMount{Name: "beat", MountPath: "/beat"})
	}
}

// releasesOf counts the example driver's release records of device id.
func releasesOf(record, id string) int {
	n := 0
	for _, l := range strings.Split(readFile(record), "\n") {
		if l == "released "+id {
			n++
		}
	}
	return n
}

func readFile(path string) string {
	data, _ := os.ReadFile(path)
	return string(data)
}
