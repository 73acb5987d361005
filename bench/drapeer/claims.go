package main

// Prepare and Unprepare: a CDI spec per claim and a checkpoint of the prepared claims, both
// flushed to disk before the answer.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
)

// preparedDevice is one device of a prepared claim, as the checkpoint keeps it.
type preparedDevice struct {
	Request string `json:"request"`
	Pool    string `json:"pool"`
	Device  string `json:"device"`
	CDIID   string `json:"cdiId"`
}

// driver is the DRAPlugin the helper calls.
type driver struct {
	c       config
	publish func(context.Context) error
	// mu guards unhealthy (the health watch and the slices read it) and prepared.
	mu        sync.Mutex
	unhealthy map[string]bool
	prepared  map[types.UID][]preparedDevice
	reports   []chan struct{}
}

func newDriver(c config) (*driver, error) {
	d := &driver{c: c, unhealthy: map[string]bool{}, prepared: map[types.UID][]preparedDevice{}}
	data, err := os.ReadFile(d.checkpointPath())
	if err == nil {
		err = json.Unmarshal(data, &d.prepared)
	}
	if err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("checkpoint %s: %w", d.checkpointPath(), err)
	}
	return d, nil
}

func (d *driver) checkpointPath() string { return filepath.Join(d.c.stateDir, "checkpoint.json") }

func (d *driver) specPath(uid types.UID) string {
	return filepath.Join(d.c.cdiDir, strings.ReplaceAll(d.c.driver, "/", "_")+"-"+string(uid)+".json")
}

// PrepareResourceClaims prepares each claim on its own; a claim prepared before gets the same
// answer again.
func (d *driver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		devices, err := d.prepare(claim)
		out[claim.UID] = result(devices, err)
	}
	return out, nil
}

func result(devices []preparedDevice, err error) kubeletplugin.PrepareResult {
	if err != nil {
		return kubeletplugin.PrepareResult{Err: err}
	}
	var r kubeletplugin.PrepareResult
	for _, p := range devices {
		r.Devices = append(r.Devices, kubeletplugin.Device{
			Requests: []string{p.Request}, PoolName: p.Pool, DeviceName: p.Device, CDIDeviceIDs: []string{p.CDIID},
		})
	}
	return r
}

func (d *driver) prepare(claim *resourceapi.ResourceClaim) ([]preparedDevice, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if done, ok := d.prepared[claim.UID]; ok {
		return done, nil
	}
	devices, err := d.plan(claim)
	if err != nil {
		return nil, err
	}
	if err := writeSynced(d.specPath(claim.UID), d.spec(claim.UID, devices), false); err != nil {
		return nil, fmt.Errorf("CDI spec of claim %s/%s: %w", claim.Namespace, claim.Name, err)
	}
	d.prepared[claim.UID] = devices
	if err := d.writeCheckpoint(); err != nil {
		delete(d.prepared, claim.UID)
		return nil, err
	}
	return devices, nil
}

// plan maps the claim's allocation results of this driver to devices, refusing a device that
// does not exist or that another prepared claim holds.
func (d *driver) plan(claim *resourceapi.ResourceClaim) ([]preparedDevice, error) {
	if claim.Status.Allocation == nil {
		return nil, fmt.Errorf("claim %s/%s is not allocated", claim.Namespace, claim.Name)
	}
	var devices []preparedDevice
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver != d.c.driver {
			continue
		}
		if r.Pool != d.c.node || d.index(r.Device) < 0 {
			return nil, fmt.Errorf("claim %s/%s: no device %s/%s here", claim.Namespace, claim.Name, r.Pool, r.Device)
		}
		if holder := d.holder(r.Device); holder != "" {
			return nil, fmt.Errorf("claim %s/%s: device %s is prepared for claim %s", claim.Namespace, claim.Name, r.Device, holder)
		}
		devices = append(devices, preparedDevice{
			Request: r.Request, Pool: r.Pool, Device: r.Device,
			CDIID: fmt.Sprintf("%s/claim=%s-%s", d.c.driver, claim.UID, r.Device),
		})
	}
	return devices, nil
}

// index is the number of device `name` (example-<n>), or -1.
func (d *driver) index(name string) int {
	n, err := strconv.Atoi(strings.TrimPrefix(name, "example-"))
	if err != nil || !strings.HasPrefix(name, "example-") || n < 0 || n >= d.c.devices {
		return -1
	}
	return n
}

func (d *driver) holder(device string) types.UID {
	for uid, devices := range d.prepared {
		for _, p := range devices {
			if p.Device == device {
				return uid
			}
		}
	}
	return ""
}

// spec is the claim's CDI spec: each device's node and its visible-devices variable.
func (d *driver) spec(uid types.UID, devices []preparedDevice) []byte {
	type node struct {
		Path     string `json:"path"`
		HostPath string `json:"hostPath"`
	}
	type edits struct {
		Env         []string `json:"env"`
		DeviceNodes []node   `json:"deviceNodes"`
	}
	type device struct {
		Name           string `json:"name"`
		ContainerEdits edits  `json:"containerEdits"`
	}
	spec := struct {
		Version string   `json:"cdiVersion"`
		Kind    string   `json:"kind"`
		Devices []device `json:"devices"`
	}{Version: "0.6.0", Kind: d.c.driver + "/claim"}
	for _, p := range devices {
		spec.Devices = append(spec.Devices, device{
			Name: fmt.Sprintf("%s-%s", uid, p.Device),
			ContainerEdits: edits{
				Env:         []string{"EXAMPLE_VISIBLE_DEVICES=" + p.Device},
				DeviceNodes: []node{{Path: fmt.Sprintf("/dev/example%d", d.index(p.Device)), HostPath: "/dev/null"}},
			},
		})
	}
	data, err := json.Marshal(spec)
	runtime.Must(err)
	return data
}

func (d *driver) writeCheckpoint() error {
	data, err := json.Marshal(d.prepared)
	if err == nil {
		err = writeSynced(d.checkpointPath(), data, true)
	}
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", d.checkpointPath(), err)
	}
	return nil
}

// UnprepareResourceClaims removes each claim's CDI spec and writes the checkpoint; a claim not
// prepared is no error.
func (d *driver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[types.UID]error, len(claims))
	changed := false
	for _, claim := range claims {
		out[claim.UID] = nil
		if _, ok := d.prepared[claim.UID]; !ok {
			continue
		}
		if err := os.Remove(d.specPath(claim.UID)); err != nil && !os.IsNotExist(err) {
			out[claim.UID] = fmt.Errorf("CDI spec of claim %s: %w", claim, err)
			continue
		}
		delete(d.prepared, claim.UID)
		changed = true
	}
	if changed {
		if err := d.writeCheckpoint(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// HandleError logs background errors (slice publishing); every one is retried by the helper.
func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	runtime.HandleErrorWithContext(ctx, err, msg)
}

// writeSynced writes `data` to a temporary file beside `path`, flushes it, renames it over
// `path` and, with syncDir, flushes the folder too.
func writeSynced(path string, data []byte, syncDir bool) error {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil || !syncDir {
		return err
	}
	dir, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer dir.Close()
	return dir.Sync()
}
