package containers_test

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"devhost.test/cluster/internal/devhost"
)

// ticker opens each of its /dev/example* nodes five times a second, printing
// "tick <n> <node> ok" or why not, until SIGTERM.
const ticker = `echo done
trap 'exit 0' TERM
n=0
while :; do
  n=$((n+1))
  for d in /dev/example*; do
    if err=$( (: > "$d") 2>&1 ); then echo "tick $n $d ok"; else echo "tick $n $d failed: $err"; fi
  done
  sleep 0.2
done`

// allocatableGaps samples the Node's example.com/accel allocatable every 100 ms until stop is
// closed and returns the longest time it was below want, and how often it was.
func allocatableGaps(want int64, stop <-chan struct{}) func() (time.Duration, int) {
	var mu sync.Mutex
	var longest time.Duration
	gaps := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		var since time.Time
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			nd, err := cl.Node()
			if err != nil {
				continue
			}
			q := nd.Status.Allocatable["example.com/accel"]
			mu.Lock()
			if q.Value() < want && since.IsZero() {
				since, gaps = time.Now(), gaps+1
			} else if q.Value() >= want && !since.IsZero() {
				longest = max(longest, time.Since(since))
				since = time.Time{}
			}
			mu.Unlock()
		}
	}()
	return func() (time.Duration, int) { <-done; mu.Lock(); defer mu.Unlock(); return longest, gaps }
}

func readLines(path string) []string {
	data, _ := os.ReadFile(path)
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}

// rollingUpgrade: two pods hold example.com/accel devices; the DaemonSet's image moves to a v2
// tag (the rendered maxUnavailable 1, maxSurge 0: the old pod goes first); one holder is
// deleted while devhost is replaced. The other's container keeps running and keeps opening its
// devices throughout; the new devhost pod runs v2 and becomes Ready; every device is allocatable
// again (the gap is measured); the release hook runs exactly once for the deleted holder's device
// and never for the running one's; a new pod is never given a device that the running one holds.
func rollingUpgrade(t *testing.T, ds *appsv1.DaemonSet) {
	ctx := context.Background()
	a := scriptPod(t, "holder-a", ticker, map[string]int64{"example.com/accel": 2})
	b := scriptPod(t, "holder-b", ticker, map[string]int64{"example.com/accel": 1})
	containerOutput(t, a, 90*time.Second)
	containerOutput(t, b, 90*time.Second)
	aIDs, bIDs := heldIDs(t, a.Name), heldIDs(t, b.Name)
	if len(aIDs) != 2 || len(bIDs) != 1 {
		t.Fatalf("PodResources: holder-a %v, holder-b %v", aIDs, bIDs)
	}
	old := devhostPod(t, ds, 10*time.Second, "")
	before := len(readLines(releaseRecord))
	ticksBefore := strings.Count(podLog(t, a, "main"), "tick ")

	stop := make(chan struct{})
	gaps := allocatableGaps(4, stop)
	cur, err := cl.Client.AppsV1().DaemonSets(ds.Namespace).Get(ctx, ds.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	v1Image := cur.Spec.Template.Spec.Containers[0].Image
	v2Image := v1Image[:strings.LastIndex(v1Image, ":")] + ":v2"
	if _, err := cl.Containerd.Ctr("images", "tag", "--force", "docker.io/library/devhost:ci", v2Image); err != nil {
		t.Fatal(err)
	}
	cur.Spec.Template.Spec.Containers[0].Image = v2Image
	start := time.Now()
	if _, err := cl.Client.AppsV1().DaemonSets(ds.Namespace).Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	devhost.Eventually(t, 60*time.Second, "the old devhost pod gone", func() string {
		if _, err := cl.Client.CoreV1().Pods(old.Namespace).Get(ctx, old.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			return fmt.Sprintf("still there (%v)", err)
		}
		return ""
	})
	gone := time.Since(start)
	deletePod(t, b.Name) // let go of while devhost is being replaced
	fresh := devhostPod(t, ds, 120*time.Second, v2Image)
	readyAfter := time.Since(start)
	waitDaemonSetResources(t)
	back := time.Since(start)
	close(stop)
	longest, count := gaps()
	t.Logf("upgrade to %s: old pod gone after %v, new pod %s Ready after %v, every device allocatable after %v; "+
		"example.com/accel below 4 allocatable %d time(s), longest %v (sampled every 100 ms)",
		v2Image, gone.Round(time.Millisecond), fresh.Name, readyAfter.Round(time.Millisecond), back.Round(time.Millisecond), count, longest.Round(time.Millisecond))

	devhost.Eventually(t, 30*time.Second, "the release hook ran for holder-b's device", func() string {
		if n := len(readLines(releaseRecord)); n == before {
			return fmt.Sprintf("%s has %d line(s), as before the upgrade", releaseRecord, n)
		}
		return ""
	})
	time.Sleep(2 * time.Second) // a second release would come within one poll interval
	released := readLines(releaseRecord)[before:]
	if want := "released " + bIDs[0]; len(released) != 1 || released[0] != want {
		t.Errorf("the release hook ran %q during the upgrade, want exactly %q", released, want)
	}

	p, err := cl.Client.CoreV1().Pods("default").Get(ctx, a.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if s := p.Status.ContainerStatuses; len(s) != 1 || s[0].RestartCount != 0 || s[0].State.Running == nil {
		t.Errorf("holder-a's container did not keep running through the upgrade: %+v", s)
	}
	if ticks := checkTicks(t, p, aIDs); ticks <= ticksBefore+2 {
		t.Errorf("holder-a's container opened its devices %d times before the upgrade and %d in all: it stopped", ticksBefore, ticks)
	}
	if got := heldIDs(t, a.Name); strings.Join(got, ",") != strings.Join(aIDs, ",") {
		t.Errorf("holder-a holds %v after the upgrade, %v before", got, aIDs)
	}
	c := shellPod(t, "holder-c", probeDevices, map[string]int64{"example.com/accel": 2})
	containerOutput(t, c, 90*time.Second)
	for _, id := range heldIDs(t, c.Name) {
		for _, held := range aIDs {
			if id == held {
				t.Errorf("holder-c was given %s, which running holder-a holds", id)
			}
		}
	}
}

// checkTicks: every tick of holder-a's container opened both its devices; it returns how many
// opens there were.
func checkTicks(t *testing.T, p *v1.Pod, ids []string) int {
	t.Helper()
	var nodes []string
	for _, id := range ids {
		nodes = append(nodes, fmt.Sprintf("/dev/example%d", exampleIndex(t, id)))
	}
	sort.Strings(nodes)
	seen := map[string]bool{}
	ticks := 0
	for _, l := range strings.Split(podLog(t, p, "main"), "\n") {
		if !strings.HasPrefix(l, "tick ") {
			continue
		}
		f := strings.Fields(l)
		if len(f) < 4 || f[3] != "ok" {
			t.Errorf("holder-a's container: %s", l)
			continue
		}
		seen[f[2]] = true
		ticks++
	}
	var got []string
	for n := range seen {
		got = append(got, n)
	}
	sort.Strings(got)
	if strings.Join(got, ",") != strings.Join(nodes, ",") {
		t.Errorf("holder-a's container opened %v, want its devices' nodes %v", got, nodes)
	}
	t.Logf("holder-a's container opened its devices %d times, every time successfully", ticks)
	return ticks
}
