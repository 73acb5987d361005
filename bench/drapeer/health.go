package main

// The devices and their health: the slice the helper publishes (an unhealthy device tainted),
// the health file's watch, and the reports for the kubelet's health service.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// resendEvery is how often the health reports are sent again while nothing changes (the
// kubelet counts a device unknown after 30 s without one).
const resendEvery = 10 * time.Second

func (d *driver) deviceName(i int) string { return "example-" + strconv.Itoa(i) }

// resources is what the slice holds now: every device, an unhealthy one tainted. The
// attributes are those devhost publishes for the C example (one NUMA node, its default).
func (d *driver) resources() resourceslice.DriverResources {
	d.mu.Lock()
	defer d.mu.Unlock()
	devices := make([]resourceapi.Device, 0, d.c.devices)
	for i := 0; i < d.c.devices; i++ {
		dev := resourceapi.Device{
			Name: d.deviceName(i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"index":    {IntValue: ptr.To(int64(i))},
				"model":    {StringValue: ptr.To("example-v1")},
				"numaNode": {IntValue: ptr.To(int64(0))},
				"vendor":   {StringValue: ptr.To("example.com")},
			},
		}
		if d.unhealthy[dev.Name] {
			dev.Taints = []resourceapi.DeviceTaint{{Key: d.c.driver + "/unhealthy", Effect: resourceapi.DeviceTaintEffectNoSchedule}}
		}
		devices = append(devices, dev)
	}
	pool := resourceslice.Pool{Slices: []resourceslice.Slice{{Devices: devices}}}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{d.c.node: pool}}
}

// readHealth reads the health file; reports whether the set of unhealthy devices changed.
func (d *driver) readHealth() (bool, error) {
	data, err := os.ReadFile(d.c.healthFile)
	if err != nil && !os.IsNotExist(err) {
		return false, err
	}
	now := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		if name := strings.TrimSpace(line); name != "" {
			now[name] = true
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	changed := len(now) != len(d.unhealthy)
	for name := range now {
		changed = changed || !d.unhealthy[name]
	}
	d.unhealthy = now
	return changed, nil
}

// watchHealth publishes the slice, then publishes it again and tells the health reports
// whenever the health file changes, until ctx ends.
func (d *driver) watchHealth(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer w.Close()
	// The folder: the file may not exist yet, or be replaced.
	if err := w.Add(filepath.Dir(d.c.healthFile)); err != nil {
		return fmt.Errorf("watching %s: %w", d.c.healthFile, err)
	}
	if _, err := d.readHealth(); err != nil {
		return fmt.Errorf("health file %s: %w", d.c.healthFile, err)
	}
	if err := d.publish(ctx); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-w.Errors:
			klog.FromContext(ctx).Error(err, "health file watch")
		case ev := <-w.Events:
			if filepath.Clean(ev.Name) != filepath.Clean(d.c.healthFile) {
				continue
			}
			changed, err := d.readHealth()
			if err != nil {
				klog.FromContext(ctx).Error(err, "health file", "path", d.c.healthFile)
				continue
			}
			if changed {
				if err := d.publish(ctx); err != nil {
					klog.FromContext(ctx).Error(err, "publishing the slice")
				}
				d.notifyReports()
			}
		}
	}
}

func (d *driver) notifyReports() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, ch := range d.reports {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

func (d *driver) report() kubeletplugin.DeviceHealthReport {
	d.mu.Lock()
	defer d.mu.Unlock()
	var r kubeletplugin.DeviceHealthReport
	now := time.Now()
	for i := 0; i < d.c.devices; i++ {
		h := kubeletplugin.DeviceHealth{PoolName: d.c.node, DeviceName: d.deviceName(i), Health: kubeletplugin.HealthStatusHealthy, LastUpdated: now}
		if d.unhealthy[h.DeviceName] {
			h.Health, h.Message = kubeletplugin.HealthStatusUnhealthy, "named in the health file"
		}
		r.Devices = append(r.Devices, h)
	}
	return r
}

// WatchHealthStatus sends every device's health at once, on each change and every resendEvery.
func (d *driver) WatchHealthStatus(ctx context.Context, reports chan<- kubeletplugin.DeviceHealthReport) error {
	changed := make(chan struct{}, 1)
	d.mu.Lock()
	d.reports = append(d.reports, changed)
	d.mu.Unlock()
	defer d.dropReports(changed)
	tick := time.NewTicker(resendEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case reports <- d.report():
		}
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		case <-tick.C:
		}
	}
}

func (d *driver) dropReports(ch chan struct{}) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i, c := range d.reports {
		if c == ch {
			d.reports = append(d.reports[:i], d.reports[i+1:]...)
			return
		}
	}
}
