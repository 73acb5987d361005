// Stale claims with the real kubelet: devhost unprepares by itself a prepared claim gone from
// the API server only when the kubelet's PodResources shows no pod it was reserved for and no
// container listing it (host/src/fronts/dra/stale.rs). The emulator tests
// (host/tests/integration/dra/stale.rs) show the clean-up; this one shows that the real
// kubelet's list keeps a running pod's claim prepared, and that the claim is released once.
package dra_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"devhost.test/cluster/internal/devhost"
)

// A running pod's claim is taken out of the API server under it (its reservation and
// finalizer removed, then deleted; the claim controller then makes a successor, which the
// kubelet names from then on): devhost's check, every second here, sees the claim gone, finds
// its pod in the real kubelet's PodResources and leaves it prepared; once the pod is deleted the
// device is released once.
func TestClaimGoneFromTheAPIServerStaysPreparedWhileItsPodRuns(t *testing.T) {
	n := startPublishing(t, devhost.DRAOptions{Accel: true, ClaimCheckInterval: "1s"})
	id, name := preparedAccelPod(t, n, "outlives-its-claim")
	removeClaimUnderItsPod(t, name)

	devhost.Eventually(t, 30*time.Second, "devhost's check keeps the claim of the running pod", func() string {
		if lines := n.logLines("stays prepared", name); len(lines) == 0 {
			return "no such log line yet; devhost log tail:\n" + n.logTail(20)
		}
		return ""
	})
	time.Sleep(3 * time.Second) // three more checks
	if r := readFile(t, n.release); strings.Contains(r, id) {
		t.Fatalf("%s released while its pod runs: release record %q; devhost log tail:\n%s", id, r, n.logTail(20))
	}
	if lines := n.logLines("unprepared a stale claim"); len(lines) != 0 {
		t.Fatalf("devhost unprepared a claim a running container lists: %v", lines)
	}
	if p := getPod(t, "outlives-its-claim"); p.Status.Phase != v1.PodRunning {
		t.Fatalf("the pod left Running:\n%s", describe("outlives-its-claim", n))
	}

	deletePod(t, "outlives-its-claim")
	devhost.Eventually(t, 60*time.Second, "the release hook ran for "+id, func() string {
		if r := readFile(t, n.release); strings.Count(r, id) != 1 {
			return fmt.Sprintf("release record %q should name %s once; devhost log tail:\n%s", r, id, n.logTail(20))
		}
		return ""
	})
	// Either the kubelet's Unprepare or devhost's next check, whichever comes first.
	t.Logf("unprepared: %v", n.logLines("unprepared", name))
}

// removeClaimUnderItsPod deletes claim `name` while its pod runs, as a user with rights on it
// can: its reservation cleared, its finalizers dropped, then deleted.
func removeClaimUnderItsPod(t *testing.T, name string) {
	t.Helper()
	claims := cl.Client.ResourceV1().ResourceClaims(ns)
	// Merge patches: the claim controller writes the claim too, so an Update could conflict.
	_, err := claims.Patch(ctx(), name, types.MergePatchType, []byte(`{"status":{"reservedFor":null}}`), metav1.PatchOptions{}, "status")
	if err != nil {
		t.Fatalf("clearing claim %s's reservation: %v", name, err)
	}
	_, err = claims.Patch(ctx(), name, types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`), metav1.PatchOptions{})
	if err != nil {
		t.Fatalf("dropping claim %s's finalizers: %v", name, err)
	}
	if err = claims.Delete(ctx(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Fatalf("deleting claim %s: %v", name, err)
	}
	devhost.Eventually(t, 30*time.Second, "claim "+name+" gone from the API server", func() string {
		_, err := claims.Get(ctx(), name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return ""
		}
		return fmt.Sprintf("still there (%v)", err)
	})
}
