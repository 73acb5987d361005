package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// The images every containerd cluster has, built here (nothing can be pulled): the sandbox's
// pause process, and a static busybox (Debian's busybox-static) for the test containers, whose
// entrypoint is /bin/sh.
const (
	PauseImage   = "localhost/devhost-test/pause:1"
	BusyboxImage = "localhost/devhost-test/busybox:1"
)

// CDIDirs are the folders containerd reads CDI specs from (its defaults; the later wins). Both
// are private tmpfs mounts of the test binary (nodens.EnterNode), so devhost writes its specs
// where a node's runtime reads them without touching the machine's.
var CDIDirs = []string{"/etc/cdi", "/var/run/cdi"}

// PodSubnet is the bridge network of the pods that do not use the host network; it exists only
// in the test binary's own network namespace (nodens.EnterNode).
const PodSubnet = "10.88.0.0/16"

// Containerd is the real container runtime of a cluster started with Options.Containerd:
// containerd, its runc shim and runc, and the CNI bridge plugin, from tests/cluster/build-runtime.
type Containerd struct {
	Bin, Dir, Socket, RuncRoot string
	proc                       *Proc
}

// runtimeBin is the folder of the runtime's binaries: $DEVHOST_RUNTIME_BIN, else what
// tests/cluster/build-runtime prints (it builds on first use, then answers at once).
func runtimeBin() (string, error) {
	if bin := os.Getenv("DEVHOST_RUNTIME_BIN"); bin != "" {
		return bin, nil
	}
	script := filepath.Join(Root(), "build-runtime")
	cmd := exec.Command(script)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w", script, err)
	}
	return strings.TrimSpace(string(out)), nil
}

// startContainerd writes containerd's configuration and the CNI network under the cluster's
// folder, starts it, imports the test images and returns its CRI socket.
func (c *Cluster) startContainerd() (string, error) {
	bin, err := runtimeBin()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(c.Dir, "containerd")
	// The socket in a folder of its own, which devhost's DaemonSet pod mounts as it mounts the
	// node's /run/containerd (runtime_socket), without containerd's root and state.
	rt := &Containerd{Bin: bin, Dir: dir, Socket: filepath.Join(dir, "sock", "containerd.sock"), RuncRoot: filepath.Join(dir, "runc")}
	for _, d := range append([]string{dir, filepath.Join(dir, "cni"), filepath.Dir(rt.Socket), rt.RuncRoot}, CDIDirs...) {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", err
		}
	}
	if err := writeFile(filepath.Join(dir, "cni", "10-devhost-test.conflist"), cniConfig(dir)); err != nil {
		return "", err
	}
	config := filepath.Join(dir, "config.toml")
	if err := writeFile(config, containerdConfig(rt, CDIDirs)); err != nil {
		return "", err
	}
	c.Containerd = rt
	if err := c.runContainerd(); err != nil {
		return "", err
	}
	if err := rt.importImages(); err != nil {
		return "", err
	}
	return rt.Socket, nil
}

// runContainerd starts the containerd process on the configuration startContainerd wrote.
func (c *Cluster) runContainerd() error {
	rt := c.Containerd
	p, err := c.startFrom(rt.Bin, "containerd", []string{"PATH=" + rt.Bin + ":" + os.Getenv("PATH")},
		"--config", filepath.Join(rt.Dir, "config.toml"))
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	rt.proc = p
	return waitSocket(rt.Socket, p, 30*time.Second)
}

// PowerOff is what a node's power loss does to its runtime: the kubelet and containerd are
// killed (SIGKILL) with every container, and what lives in tmpfs is gone: containerd's state,
// runc's, the shims' sockets, and the CDI folder /var/run/cdi. What is on disk stays: the
// images, the kubelet's folder (its device checkpoint; the plugin sockets left in it are stale).
func (c *Cluster) PowerOff() error {
	rt := c.Containerd
	if rt == nil {
		return fmt.Errorf("PowerOff needs a cluster with Options.Containerd")
	}
	c.kubelet.Stop(syscall.SIGKILL)
	rt.removeContainers()
	rt.proc.Stop(syscall.SIGKILL)
	tmpfs := []string{filepath.Join(rt.Dir, "state"), rt.RuncRoot, shimSocketDir, "/var/run/cdi"}
	unmountUnder(tmpfs)
	for _, d := range tmpfs {
		entries, _ := os.ReadDir(d)
		for _, e := range entries {
			if err := os.RemoveAll(filepath.Join(d, e.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// unmountUnder detaches every mount below the folders (the sandboxes' shm and network
// namespaces, the containers' root file systems), deepest first, as a power-off does.
func unmountUnder(dirs []string) {
	data, _ := os.ReadFile("/proc/self/mountinfo")
	var points []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		for _, d := range dirs {
			if strings.HasPrefix(f[4], d+"/") {
				points = append(points, f[4])
			}
		}
	}
	for i := len(points) - 1; i >= 0; i-- {
		_ = syscall.Unmount(points[i], syscall.MNT_DETACH)
	}
}

// PowerOnRuntime starts containerd again after PowerOff (StartKubelet starts the kubelet).
func (c *Cluster) PowerOnRuntime() error {
	if c.Containerd == nil {
		return fmt.Errorf("PowerOnRuntime needs a cluster with Options.Containerd")
	}
	return c.runContainerd()
}

// shimSocketDir is where the shims' sockets go: containerd refuses a folder name longer than 42
// bytes, so not under the test's folder but on the test binary's own /var/lib (nodens).
const shimSocketDir = "/var/lib/devhost-test-shim"

// containerdConfig is containerd 2.x's configuration (version 4, the one `containerd config
// default` prints): every address, root and socket folder under the test's folder, since keys
// containerd does not know are silently ignored and it would use /run/containerd otherwise.
func containerdConfig(rt *Containerd, cdiDirs []string) string {
	quoted := make([]string, len(cdiDirs))
	for i, d := range cdiDirs {
		quoted[i] = fmt.Sprintf("%q", d)
	}
	return fmt.Sprintf(`version = 4
root = %[1]q
state = %[2]q
imports = []

[plugins.'io.containerd.server.v1.grpc']
  address = %[3]q
[plugins.'io.containerd.server.v1.ttrpc']
  address = %[4]q
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = %[5]q
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = %[6]q
[plugins.'io.containerd.cri.v1.runtime']
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower a process's oom_score_adj.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  cdi_spec_dirs = [%[7]s]
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = %[8]q
  Root = %[9]q
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = [%[10]q]
  conf_dir = %[11]q
`, filepath.Join(rt.Dir, "root"), filepath.Join(rt.Dir, "state"), rt.Socket, rt.Socket+".ttrpc",
		shimSocketDir, PauseImage, strings.Join(quoted, ", "),
		filepath.Join(rt.Bin, "runc"), rt.RuncRoot, rt.Bin, filepath.Join(rt.Dir, "cni"))
}

// cniConfig is a bridge network with host-local addresses, no masquerading (nothing leaves the
// namespace) and no port mapping.
func cniConfig(dir string) string {
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "devhost-test",
  "plugins": [{
    "type": "bridge", "bridge": "devhost0", "isGateway": true, "ipMasq": false,
    "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "dataDir": %q}
  }]
}
`, PodSubnet, filepath.Join(dir, "ipam"))
}

func waitSocket(path string, p *Proc, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if st, err := os.Stat(path); err == nil && st.Mode()&os.ModeSocket != 0 {
			return nil
		}
		if p.Exited() {
			return fmt.Errorf("%s exited", p.Name)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s did not make %s within %v", p.Name, path, timeout)
}

// Ctr runs containerd's own client in the CRI's namespace (k8s.io) and returns its output.
func (rt *Containerd) Ctr(args ...string) (string, error) {
	cmd := exec.Command(filepath.Join(rt.Bin, "ctr"), append([]string{"--address", rt.Socket, "--namespace", "k8s.io"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// ImportArchive imports an image archive (an OCI layout, or `docker save`'s) into the CRI's
// namespace, unpacked for the default snapshotter.
func (rt *Containerd) ImportArchive(path string) error {
	_, err := rt.Ctr("images", "import", "--local", path)
	return err
}

// importImages builds the pause and busybox images (tests/cluster/images/ociimage) and imports
// them.
func (rt *Containerd) importImages() error {
	busybox, err := exec.LookPath("busybox")
	if err != nil {
		return fmt.Errorf("no busybox on PATH (Debian's busybox-static; scripts/install-deps installs it): %w", err)
	}
	images := [][]string{
		{"-name", PauseImage, "-entrypoint", "/pause", filepath.Join(rt.Bin, "pause") + "=/pause"},
		{"-name", BusyboxImage, "-entrypoint", "/bin/sh", "-link", "/bin/sh=busybox", busybox + "=/bin/busybox"},
	}
	for i, args := range images {
		archive := filepath.Join(rt.Dir, fmt.Sprintf("image-%d.tar", i))
		cmd := exec.Command(filepath.Join(rt.Bin, "ociimage"), append([]string{"-o", archive}, args...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("ociimage %s: %v: %s", args[1], err, out)
		}
		if err := rt.ImportArchive(archive); err != nil {
			return err
		}
	}
	return nil
}

// removeContainers kills and deletes every container runc runs for this containerd (they
// outlive containerd and its shims otherwise), then the shims, and removes the cgroup folders
// containerd made for its namespace once they are empty (cgroups are not namespaced).
func (rt *Containerd) removeContainers() {
	runc := filepath.Join(rt.Bin, "runc")
	out, _ := exec.Command(runc, "--root", filepath.Join(rt.RuncRoot, "k8s.io"), "list", "-q").Output()
	for _, id := range strings.Fields(string(out)) {
		_ = exec.Command(runc, "--root", filepath.Join(rt.RuncRoot, "k8s.io"), "delete", "--force", id).Run()
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, f := range procs {
		cmdline, err := os.ReadFile(f)
		if err != nil || !strings.Contains(string(cmdline), "containerd-shim") || !strings.Contains(string(cmdline), rt.Socket) {
			continue
		}
		var pid int
		if _, err := fmt.Sscanf(f, "/proc/%d/cmdline", &pid); err == nil {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	parents, _ := filepath.Glob("/sys/fs/cgroup/*/k8s.io")
	for _, p := range parents {
		_ = os.Remove(p) // fails, harmlessly, while another cluster's containers are in it
	}
}
