package containers_test

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"devhost.test/cluster/internal/cluster"
	"devhost.test/cluster/internal/devhost"
)

// probeDevices prints, for every /dev/example* node the container has, its type and
// major:minor and whether opening it for writing succeeds ("open <path> ok") or why not; then
// the example driver's env.
const probeDevices = `for d in /dev/example*; do
  [ -e "$d" ] || { echo "no example nodes"; break; }
  echo "node $d $(stat -c '%F %t:%T' "$d")"
  if err=$( (: > "$d") 2>&1 ); then echo "open $d ok"; else echo "open $d failed: $err"; fi
done
echo "env EXAMPLE_VISIBLE_DEVICES=$EXAMPLE_VISIBLE_DEVICES"
echo "env EXAMPLE_ALLOCATED=$EXAMPLE_ALLOCATED"`

// probeCgroup makes a node of every example device itself (containers keep CAP_MKNOD), as
// /dev/probe<i>, and tries to open it: only the device cgroup stands in the way.
func probeCgroup() string {
	var b strings.Builder
	for i, n := range exampleNodes {
		fmt.Fprintf(&b, `mknod /dev/probe%[1]d c %[2]d %[3]d && echo "probe %[1]d $(stat -c '%%t:%%T' /dev/probe%[1]d)"
if err=$( (: > /dev/probe%[1]d) 2>&1 ); then echo "open probe %[1]d ok"; else echo "open probe %[1]d failed: $err"; fi
`, i, n.major, n.minor)
	}
	return b.String()
}

// TestContainerGetsExactlyItsDevicesNodesAndEnv: a pod asking for two example.com/accel devices
// runs on containerd and runc; inside, its container has exactly the device nodes of the
// devices the kubelet assigned (PodResources), as character devices with their host nodes'
// major:minor, and may open each, with the driver's env. Nodes it makes itself for all four
// devices open only for its own two: its device cgroup allows exactly them. A pod that asked for
// nothing has no such node, and its device cgroup refuses all four.
func TestContainerGetsExactlyItsDevicesNodesAndEnv(t *testing.T) {
	nodes := "/var/lib/devhost-test-nodes"
	makeExampleNodes(t, nodes)
	startDevhost(t, devhost.Options{ExampleDevDir: nodes})

	with := shellPod(t, "with-accel", probeDevices+"\n"+probeCgroup(), map[string]int64{"example.com/accel": 2})
	without := shellPod(t, "without", probeDevices+"\n"+probeCgroup(), nil)
	withOut := containerOutput(t, with, 90*time.Second)
	withoutOut := containerOutput(t, without, 90*time.Second)
	t.Logf("with-accel's container:\n%s", strings.Join(withOut, "\n"))
	t.Logf("without's container:\n%s", strings.Join(withoutOut, "\n"))

	devs, err := cluster.PodDevices("default", with.Name)
	if err != nil {
		t.Fatal(err)
	}
	ids := devs["example.com/accel"]
	sort.Strings(ids)
	if len(ids) != 2 {
		t.Fatalf("PodResources: with-accel holds %v of example.com/accel, want 2 devices", devs)
	}
	var want []string
	held := map[int]bool{}
	for _, id := range ids {
		i, err := strconv.Atoi(strings.TrimPrefix(id, "example-"))
		if err != nil || i >= len(exampleNodes) {
			t.Fatalf("unexpected device ID %q", id)
		}
		held[i] = true
		n := exampleNodes[i]
		path := fmt.Sprintf("/dev/example%d", i)
		want = append(want,
			fmt.Sprintf("node %s character special file %x:%x", path, n.major, n.minor),
			"open "+path+" ok")
	}
	for i, n := range exampleNodes {
		want = append(want, fmt.Sprintf("probe %d %x:%x", i, n.major, n.minor))
		if held[i] {
			want = append(want, fmt.Sprintf("open probe %d ok", i))
		} else {
			want = append(want, fmt.Sprintf("open probe %d failed: /bin/sh: can't create /dev/probe%d: Operation not permitted", i, i))
		}
	}
	got := strings.Join(withOut, "\n")
	// The IDs in the order the kubelet asked for them.
	if v := envValue(withOut, "EXAMPLE_VISIBLE_DEVICES"); sortedList(v) != strings.Join(ids, ",") {
		t.Errorf("with-accel's container has EXAMPLE_VISIBLE_DEVICES=%q, want its devices %v", v, ids)
	}
	for _, w := range want {
		if !strings.Contains(got, w) {
			t.Errorf("with-accel's container lacks %q", w)
		}
	}
	if n := strings.Count(got, "node /dev/example"); n != 2 {
		t.Errorf("with-accel's container has %d example nodes, want exactly its 2", n)
	}
	if v := envValue(withOut, "EXAMPLE_ALLOCATED"); sortedList(v) != strings.Join(ids, ",") {
		t.Errorf("with-accel's container has EXAMPLE_ALLOCATED=%q (the allocate hook's), want its devices %v", v, ids)
	}

	gotWithout := strings.Join(withoutOut, "\n")
	if !strings.Contains(gotWithout, "no example nodes") {
		t.Errorf("a container that asked for nothing has example nodes")
	}
	for i, n := range exampleNodes {
		for _, w := range []string{
			fmt.Sprintf("probe %d %x:%x", i, n.major, n.minor),
			fmt.Sprintf("open probe %d failed: /bin/sh: can't create /dev/probe%d: Operation not permitted", i, i),
		} {
			if !strings.Contains(gotWithout, w) {
				t.Errorf("the container that asked for nothing lacks %q (its device cgroup let it open a device?)", w)
			}
		}
	}
}

// envValue is the value of "env KEY=VALUE" among a container's report lines.
func envValue(lines []string, key string) string {
	for _, l := range lines {
		if v, ok := strings.CutPrefix(l, "env "+key+"="); ok {
			return v
		}
	}
	return ""
}

// sortedList is a comma-separated list sorted.
func sortedList(v string) string {
	l := strings.Split(v, ",")
	sort.Strings(l)
	return strings.Join(l, ",")
}
