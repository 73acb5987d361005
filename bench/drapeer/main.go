// Command dra-peer is the DRA peer that `devhost-bench dra-peers` runs beside devhost's DRA
// front: a minimal DRA driver of the bench's own, written on the upstream kubeletplugin helper
// (k8s.io/dynamic-resource-allocation/kubeletplugin), since sigs.k8s.io/dra-example-driver
// cannot be fetched here. It is a benchmark peer only: nothing here is devhost's code, and
// devhost does not use it.
//
// What it does, so that the comparison is fair (devhost's front does the same for the C
// example driver):
//   - publishes --devices devices (example-0 …) in one pool named after the node, through the
//     helper's PublishResources, with the attributes devhost publishes for the C example;
//   - NodePrepareResources (the helper GETs each claim): one CDI device per allocated device,
//     the claim's CDI spec file written (temporary file, fsync, rename), then its checkpoint
//     (the same, and the folder flushed): three fsyncs before the answer;
//   - NodeUnprepareResources: the claim's CDI spec removed and the checkpoint written again;
//   - a health file (one unhealthy device name a line), watched with inotify (fsnotify): an
//     unhealthy device carries the taint <driver>/unhealthy (NoSchedule) in its slice, and its
//     health is reported to the kubelet's health service.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/klog/v2"
)

type config struct {
	driver, node, kubeconfig, kubeletRoot, cdiDir, stateDir, healthFile string
	devices                                                             int
	qps                                                                 float64
	burst                                                               int
}

func parseFlags() config {
	var c config
	flag.StringVar(&c.driver, "driver", "peer.example.com", "DRA driver name")
	flag.StringVar(&c.node, "node", "", "node name (required)")
	flag.StringVar(&c.kubeconfig, "kubeconfig", "", "kubeconfig of the API server (required)")
	flag.StringVar(&c.kubeletRoot, "kubelet-root", "/var/lib/kubelet", "the kubelet's root folder (plugins_registry/ and plugins/ below it)")
	flag.StringVar(&c.cdiDir, "cdi-dir", "/var/run/cdi", "where the claims' CDI specs go")
	flag.StringVar(&c.stateDir, "state-dir", "", "where the checkpoint goes (required)")
	flag.StringVar(&c.healthFile, "health-file", "", "file naming the unhealthy devices, one a line (required)")
	flag.IntVar(&c.devices, "devices", 8, "how many devices to publish")
	flag.Float64Var(&c.qps, "kube-api-qps", 5, "client-side rate limit of the API client (negative: none)")
	flag.IntVar(&c.burst, "kube-api-burst", 10, "burst of the API client's rate limit")
	klog.InitFlags(nil)
	flag.Parse()
	return c
}

func main() {
	c := parseFlags()
	if err := run(c); err != nil {
		fmt.Fprintf(os.Stderr, "dra-peer: %v\n", err)
		os.Exit(1)
	}
}

func run(c config) error {
	if c.node == "" || c.kubeconfig == "" || c.stateDir == "" || c.healthFile == "" {
		return fmt.Errorf("--node, --kubeconfig, --state-dir and --health-file are required")
	}
	rest, err := clientcmd.BuildConfigFromFlags("", c.kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig %s: %w", c.kubeconfig, err)
	}
	rest.QPS, rest.Burst = float32(c.qps), c.burst
	client, err := kubernetes.NewForConfig(rest)
	if err != nil {
		return err
	}
	for _, dir := range []string{c.cdiDir, c.stateDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	d, err := newDriver(c)
	if err != nil {
		return err
	}
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(c.driver),
		kubeletplugin.NodeName(c.node),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(filepath.Join(c.kubeletRoot, "plugins_registry")),
		kubeletplugin.PluginDataDirectoryPath(filepath.Join(c.kubeletRoot, "plugins", c.driver)),
	)
	if err != nil {
		return fmt.Errorf("starting the kubelet plugin: %w", err)
	}
	defer helper.Stop()
	d.publish = func(ctx context.Context) error { return helper.PublishResources(ctx, d.resources()) }
	return d.watchHealth(ctx)
}
