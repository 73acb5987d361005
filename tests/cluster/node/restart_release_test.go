package node_test

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"devhost.test/cluster/internal/devhost"
)

// keptState is the part of devhost's release state file (host/src/engine/release/state.rs) read here.
type keptState struct {
	Version   int `json:"version"`
	Resources map[string]struct {
		Held    map[string][]devhost.Holder `json:"held"`
		Pending []struct {
			Holder  devhost.Holder `json:"holder"`
			Devices []string       `json:"devices"`
		} `json:"pending"`
	} `json:"resources"`
}

func readKeptState(path string) (*keptState, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var s keptState
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	return &s, nil
}

func holdsOn(hs []devhost.Holder, pod string) bool {
	for _, h := range hs {
		if h.Namespace == "default" && h.Pod == pod && h.Container == "main" {
			return true
		}
	}
	return false
}

func seenAt(d time.Duration) string {
	if d < 0 {
		return "never"
	}
	return fmt.Sprintf("at %v", d.Round(time.Millisecond))
}

// freeAddr is a loopback address no one listens on now.
func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// releaseCalls counts, per device, the example driver's recorded release calls
// ("released ID,ID...\n" per successful call).
func releaseCalls(record string) (calls int, perDevice map[string]int) {
	perDevice = map[string]int{}
	for _, line := range strings.Split(strings.TrimSpace(record), "\n") {
		if line == "" {
			continue
		}
		calls++
		for _, id := range strings.Split(strings.TrimPrefix(line, "released "), ",") {
			perDevice[id]++
		}
	}
	return calls, perDevice
}

// SIGKILL to devhost while two pods hold devices of the example C driver (which has a release
// hook); one pod is deleted while devhost is down and the real kubelet's PodResources stops
// listing it; devhost started again on the same state_dir releases that pod's devices once,
// never lets the Node count them allocatable nor /status call them Healthy again before the
// hook is done, and leaves the device the other, still running pod holds alone. (Whether the
// Node shows them Unhealthy meanwhile is logged, not asserted: see docs/testing.md, "A release
// at start holds back every resource's registration".)
func TestDevicesLetGoOfWhileDevhostWasKilledAreReleasedOnceAtTheNextStart(t *testing.T) {
	r := devhost.NewRecap(t)
	const res = "example.com/accel"
	// The hook takes this long, so that a freed device served as allocatable while its hook
	// runs would show on the Node (one status update a second).
	const hookDelay = 5 * time.Second
	stateDir := filepath.Join(t.TempDir(), "state")
	addr := freeAddr(t)
	n := startDevhostWith(t, devhost.Options{
		StateDir: stateDir, MetricsAddr: addr, ReleaseDelayMs: int(hookDelay / time.Millisecond),
	})
	total := int64(len(n.resource(t, res).Devices))
	createPod(t, "let-go", map[string]int64{res: 2})
	createPod(t, "holds-on", map[string]int64{res: 1})
	waitPodPhase(t, "let-go", v1.PodRunning, 60*time.Second)
	waitPodPhase(t, "holds-on", v1.PodRunning, 60*time.Second)
	freed, kept := podDevices(t, "let-go")[res], podDevices(t, "holds-on")[res]
	if len(freed) != 2 || len(kept) != 1 {
		r.Fatalf("PodResources shows let-go with %v and holds-on with %v", freed, kept)
	}

	// devhost keeps both pods as holders in its state file before it is killed.
	// docs/features.md: release-<kubelet_dir with / as _, the leading one dropped>.json
	statePath := filepath.Join(stateDir, "release-var_lib_kubelet_device-plugins.json")
	r.Eventually(30*time.Second, "the release state file names both pods' devices", func() string {
		s, err := readKeptState(statePath)
		if err != nil {
			return err.Error()
		}
		held := s.Resources[res].Held
		for _, id := range freed {
			if !holdsOn(held[id], "let-go") {
				return fmt.Sprintf("%s held by %v", id, held[id])
			}
		}
		if !holdsOn(held[kept[0]], "holds-on") {
			return fmt.Sprintf("%s held by %v", kept[0], held[kept[0]])
		}
		return ""
	})

	r.Step("kill devhost")
	n.dh.Kill(t)
	r.Eventually(60*time.Second, "the Node shows the killed devhost's devices gone", func() string {
		if _, a := nodeCounts(t); a[res] != 0 {
			return fmt.Sprintf("allocatable %d", a[res])
		}
		return ""
	})
	deletePod(t, "let-go")
	r.Eventually(60*time.Second, "PodResources no longer lists let-go", func() string {
		if d := podDevices(t, "let-go"); len(d) != 0 {
			return fmt.Sprintf("let-go still holds %v", d)
		}
		return ""
	})
	if d := podDevices(t, "holds-on")[res]; strings.Join(d, ",") != strings.Join(kept, ",") {
		r.Fatalf("PodResources shows holds-on with %v, before the kill %v", d, kept)
	}
	if rec := readFile(t, n.release); rec != "" {
		r.Fatalf("the release hook ran while devhost was down: %q", rec)
	}

	r.Step("start devhost again")
	start := time.Now()
	n.dh = devhost.Start(t, n.config)
	// Sampled until every device of res is allocatable again: a freed device must not be
	// allocatable before the hook has run for it (the Node showed allocatable 0 while devhost
	// was down, so whatever it shows now came from the new devhost). The sample is taken
	// before the release record is read, so "not done" holds at the sample's time too.
	gpu := n.resource(t, "nvidia.com/gpu")
	registered, gpuBack, unhealthySeen, released := time.Duration(-1), time.Duration(-1), time.Duration(-1), time.Duration(-1)
	var timeline []string // each change of what the Node shows, for the log
	last := ""
	r.Eventually(90*time.Second, "the Node shows every device of "+res+" allocatable again", func() string {
		c, a := nodeCounts(t)
		at := time.Since(start)
		_, per := releaseCalls(readFile(t, n.release))
		done := true
		for _, id := range freed {
			done = done && per[id] > 0
		}
		if done && released < 0 {
			released = at
		}
		if now := fmt.Sprintf("%s %d/%d, %s %d/%d, hook done %v", res, a[res], c[res], gpu.Resource,
			a[gpu.Resource], c[gpu.Resource], done); now != last {
			timeline = append(timeline, fmt.Sprintf("%v: %s", at.Round(time.Millisecond), now))
			last = now
		}
		if !done && a[res] > total-int64(len(freed)) {
			r.Fatalf("%v after the start the Node shows %d of %d %s allocatable; the release hook has not run yet for %v",
				at, a[res], total, res, freed)
		}
		if registered < 0 && c[res] == total && a[res] > 0 {
			registered = at
		}
		if unhealthySeen < 0 && c[res] == total && a[res] == total-int64(len(freed)) {
			unhealthySeen = at
		}
		if gpuBack < 0 && a[gpu.Resource] == int64(gpu.Healthy) {
			gpuBack = at
		}
		if !done || a[res] != total {
			return fmt.Sprintf("capacity %d allocatable %d, release record %v", c[res], a[res], per)
		}
		return ""
	})
	healthySeen := time.Since(start)
	t.Logf("the Node (allocatable/capacity) after devhost started again:\n  %s", strings.Join(timeline, "\n  "))

	r.Eventually(30*time.Second, "/status shows let-go's devices released and Healthy", func() string {
		st, err := devhost.GetStatus(addr)
		if err != nil {
			return err.Error()
		}
		for _, id := range freed {
			d := st.Device(res, id)
			if d == nil {
				return id + " missing"
			}
			if d.Health != "Healthy" || len(d.HeldBy) != 0 || (len(d.Release) != 0 && string(d.Release) != "null") {
				return fmt.Sprintf("%s: health %s, held by %v, release %s", id, d.Health, d.HeldBy, d.Release)
			}
		}
		return ""
	})
	r.Step("the /status history and devhost log checks")
	st, err := devhost.GetStatus(addr)
	if err != nil {
		r.Fatalf("%v", err)
	}
	// devhost's own view: Healthy only once the hook was done (its log line's time).
	log := readFile(t, n.dh.Log)
	var hookDone time.Time
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "released ") && strings.Contains(line, "after default/let-go/main") {
			if f := strings.Fields(line); len(f) > 0 {
				hookDone, _ = time.Parse(time.RFC3339Nano, f[0])
			}
		}
	}
	if hookDone.IsZero() {
		r.Errorf("devhost's log has no \"released ... after default/let-go/main\" line")
	}
	// (When the driver's first scan comes before the release begins, the history starts with
	// Absent -> Healthy a few ms before it turns Unhealthy; the kubelet does not get that list,
	// registration waits for the release to begin, as the Node check above shows.)
	for _, id := range freed {
		d := st.Device(res, id)
		releasing := false
		for _, h := range d.History {
			at, err := time.Parse(time.RFC3339Nano, h.At)
			if err != nil {
				r.Errorf("%s: history time %q: %v", id, h.At, err)
				continue
			}
			releasing = releasing || (h.To == "Unhealthy" && strings.Contains(h.Reason, "being released after default/let-go/main let go of it"))
			if h.To == "Healthy" && releasing && at.Before(hookDone.Truncate(time.Millisecond)) {
				r.Errorf("%s turned Healthy at %s, before its release hook was done (%s): history %+v", id, h.At, hookDone.Format(time.RFC3339Nano), d.History)
			}
		}
	}
	d := st.Device(res, kept[0])
	if d == nil || d.Health != "Healthy" || !holdsOn(d.HeldBy, "holds-on") {
		r.Errorf("/status: holds-on's %s is %+v", kept[0], d)
	} else {
		for _, h := range d.History {
			if h.To != "Healthy" {
				r.Errorf("%s, still held by holds-on, went %s: %q", kept[0], h.To, h.Reason)
			}
		}
	}
	if !strings.Contains(log, "default/let-go/main let go of") || !strings.Contains(log, "while devhost was restarting or reloading") {
		r.Errorf("devhost's log lacks the release of let-go's devices at start")
	}

	// Once: a few more pod-resources rounds (every 500 ms here) call the hook no more, and
	// never for the device holds-on still holds.
	r.Step("more pod-resources rounds")
	time.Sleep(3 * time.Second)
	rec := readFile(t, n.release)
	calls, per := releaseCalls(rec)
	for _, id := range freed {
		if per[id] != 1 {
			r.Errorf("the release hook ran %d times for %s: %q", per[id], id, rec)
		}
	}
	if per[kept[0]] != 0 {
		r.Errorf("the release hook ran for %s, still held by holds-on: %q", kept[0], rec)
	}
	s, err := readKeptState(statePath)
	if err != nil {
		r.Fatalf("%v", err)
	}
	if kr := s.Resources[res]; len(kr.Pending) != 0 || !holdsOn(kr.Held[kept[0]], "holds-on") {
		r.Errorf("kept state after the release: pending %+v, held %+v", kr.Pending, kr.Held)
	}
	ids := append([]string(nil), freed...)
	sort.Strings(ids)
	t.Logf("restart after SIGKILL: %s registered on the Node %v after devhost started (nvidia.com/gpu back %v); "+
		"the Node showed %v Unhealthy (capacity %d, allocatable %d): %s; release hook (%v long, %d call(s)) "+
		"recorded %v after the start, the Node all allocatable %v after; %s still held by holds-on, not released",
		res, registered.Round(time.Millisecond), gpuBack.Round(time.Millisecond), ids, total, total-int64(len(ids)),
		seenAt(unhealthySeen), hookDelay, calls, released.Round(time.Millisecond),
		healthySeen.Round(time.Millisecond), kept[0])
	r.Step("the end (clean-up: devhost stopped with SIGTERM)")
}
