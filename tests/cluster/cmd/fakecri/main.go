// Command fakecri serves the kubelet's own fake CRI runtime (k8s.io/cri-client/pkg/fake) on a
// unix socket, so that a real kubelet runs pods without a container runtime on the machine.
// It runs nothing. What each CreateContainer request asks for (env, devices, mounts, CDI devices, annotations) is
// also written as JSON to
// <record-dir>/<pod namespace>_<pod name>_<container>.json, so that tests can read the options
// the kubelet handed the runtime.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
	"k8s.io/cri-client/pkg/util"
)

// record is the part of a ContainerConfig that devices change.
type record struct {
	Env         map[string]string `json:"env"`
	Devices     []string          `json:"devices"` // "host -> container (permissions)"
	Mounts      []string          `json:"mounts"`  // "host -> container (ro|rw)"
	CDIDevices  []string          `json:"cdi_devices"`
	Annotations map[string]string `json:"annotations"`
}

type recordingRuntime struct {
	*fake.RemoteRuntime
	dir string
}

func (r *recordingRuntime) CreateContainer(ctx context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	if err := r.record(req); err != nil {
		log.Printf("fakecri: recording CreateContainer: %v", err)
	}
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	// The fake leaves the container's log path empty, and the kubelet, removing a container,
	// deletes "<log path>*": every file in its working folder. Give it the real path.
	r.RuntimeService.Lock()
	if c, ok := r.RuntimeService.Containers[resp.GetContainerId()]; ok {
		c.LogPath = filepath.Join(req.GetSandboxConfig().GetLogDirectory(), req.GetConfig().GetLogPath())
	}
	r.RuntimeService.Unlock()
	return resp, nil
}

func (r *recordingRuntime) record(req *runtimeapi.CreateContainerRequest) error {
	meta := req.GetSandboxConfig().GetMetadata()
	name := fmt.Sprintf("%s_%s_%s.json", meta.GetNamespace(), meta.GetName(), req.GetConfig().GetMetadata().GetName())
	cfg := req.GetConfig()
	rec := record{Env: map[string]string{}, Annotations: cfg.GetAnnotations()}
	for _, e := range cfg.GetEnvs() {
		rec.Env[e.GetKey()] = string(e.GetValue())
	}
	for _, d := range cfg.GetDevices() {
		rec.Devices = append(rec.Devices, fmt.Sprintf("%s -> %s (%s)", d.GetHostPath(), d.GetContainerPath(), d.GetPermissions()))
	}
	for _, m := range cfg.GetMounts() {
		ro := "rw"
		if m.GetReadonly() {
			ro = "ro"
		}
		rec.Mounts = append(rec.Mounts, fmt.Sprintf("%s -> %s (%s)", m.GetHostPath(), m.GetContainerPath(), ro))
	}
	for _, c := range cfg.GetCDIDevices() {
		rec.CDIDevices = append(rec.CDIDevices, c.GetName())
	}
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(r.dir, "."+name)
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(r.dir, name))
}

func main() {
	endpoint := flag.String("endpoint", "", "unix:///path/to/cri.sock to serve")
	dir := flag.String("record-dir", "", "folder for one JSON file per CreateContainer request")
	images := flag.String("images", "devhost.test/pause:1", "comma-separated images present from the start")
	flag.Parse()
	if *endpoint == "" || *dir == "" {
		log.Fatal("fakecri: --endpoint and --record-dir are required")
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		log.Fatalf("fakecri: %v", err)
	}
	rt := &recordingRuntime{RemoteRuntime: fake.NewFakeRemoteRuntime(), dir: *dir}
	rt.RuntimeService.FakeStatus = &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}
	// Images "pulled" get a size: the kubelet refuses an image whose ID or size is unset.
	rt.ImageService.SetFakeImageSize(1 << 20)
	rt.ImageService.SetFakeImages(strings.Split(*images, ","))
	// The kubelet asks the runtime for its cgroup driver (RuntimeConfig RPC).
	rt.RuntimeService.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS}

	lis, err := util.CreateListener(*endpoint)
	if err != nil {
		log.Fatalf("fakecri: listen on %s: %v", *endpoint, err)
	}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, rt)
	runtimeapi.RegisterImageServiceServer(srv, rt)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-sig; srv.Stop() }()
	log.Printf("fakecri: serving on %s, recording into %s", *endpoint, *dir)
	if err := srv.Serve(lis); err != nil {
		log.Fatalf("fakecri: %v", err)
	}
}
