package cluster

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// CRIContainer is what the kubelet sent the runtime in CreateContainer (recorded by fakecri).
type CRIContainer struct {
	Env         map[string]string `json:"env"`
	Devices     []string          `json:"devices"`
	Mounts      []string          `json:"mounts"`
	CDIDevices  []string          `json:"cdi_devices"`
	Annotations map[string]string `json:"annotations"`
}

// CRIRecord waits up to 30 s for fakecri's record of the container `main` of pod namespace/pod
// and returns it; the test fails if none comes.
func (c *Cluster) CRIRecord(t testing.TB, namespace, pod string) CRIContainer {
	t.Helper()
	path := filepath.Join(c.RecordDir, namespace+"_"+pod+"_main.json")
	deadline := time.Now().Add(30 * time.Second)
	data, err := os.ReadFile(path)
	for err != nil && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
		data, err = os.ReadFile(path)
	}
	if err != nil {
		t.Fatalf("CreateContainer of %s/%s: not within 30s: %v", namespace, pod, err)
	}
	var rec CRIContainer
	if err := json.Unmarshal(data, &rec); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return rec
}

// LinesWith is every line of the file at path that contains each of the words (none if the
// file cannot be read).
func LinesWith(path string, words ...string) []string {
	data, _ := os.ReadFile(path)
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		all := true
		for _, w := range words {
			all = all && strings.Contains(line, w)
		}
		if all {
			out = append(out, line)
		}
	}
	return out
}
