// Package devhost runs the real devhost binary for the cluster tests: it writes a copy of
// config/demo.toml pointed at the debug build and at the test's folders, starts
// `devhost run` on it, and reads `devhost list --json`.
package devhost

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Root is the repository root (four folders above this one).
func Root() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", "..", ".."))
}

// Bin is the devhost binary the tests drive: $DEVHOST_BIN, else target/debug/devhost.
func Bin(t testing.TB) string {
	bin := os.Getenv("DEVHOST_BIN")
	if bin == "" {
		bin = filepath.Join(Root(), "target", "debug", "devhost")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("devhost binary %s: %v (run `cargo build --workspace` first)", bin, err)
	}
	return bin
}

// Options change the demo manifest for one test.
type Options struct {
	KubeletDir         string // kubelet_dir
	PodResourcesSocket string // pod_resources_socket ("" = a path that does not exist)
	RuntimeSocket      string // runtime_socket ("" = a path that does not exist)
	CDIDir             string // cdi_dir; with it every resource uses device_list_strategy = "cdi"
	// NvidiaCDI gives the NVIDIA driver device_list_strategy ["envvar", "cdi"] instead of the
	// resources' "cdi" strategy: its own CDI names, which devhost defines in cdi_dir.
	NvidiaCDI   bool
	HealthFile  string // the example_c driver's health file
	ReleaseFile string // the example_c driver's release record ("" = none)
	// ReleaseDelayMs is how long the example_c driver's release hook takes (its
	// release_delay_ms; 0 = at once). With it the instance's call_timeout is 60 s.
	ReleaseDelayMs int
	StateDir       string // state_dir ("" = devhost's default, /var/lib/devhost in the test's namespace)
	MetricsAddr    string // metrics_addr, for /status ("" = none)
	// ExampleDevDir is the example_c driver's dev_dir: a folder of real device nodes
	// example0..example3, the devices' host nodes ("" = /dev/null for every device).
	ExampleDevDir string
	// SimDevfs replaces the demo's simulated devfs roots of the FPGA and TPU drivers
	// (config/sim/{fpga,tpu}/dev, whose nodes are plain files) with SimDevfs/fpga and
	// SimDevfs/tpu: the same trees as real character devices (MakeSimDevfs).
	SimDevfs string
}

// WriteDemoConfig writes config/demo.toml, changed by opts, into dir and returns its path.
// Driver modules come from target/debug; the simulated trees stay relative to the
// repository root, where Start runs devhost.
func WriteDemoConfig(t testing.TB, dir string, opts Options) string {
	src, err := os.ReadFile(filepath.Join(Root(), "config", "demo.toml"))
	if err != nil {
		t.Fatal(err)
	}
	debug := filepath.Join(Root(), "target", "debug")
	text := string(src)
	health := fmt.Sprintf("%q", opts.HealthFile)
	if opts.ReleaseFile != "" {
		health += fmt.Sprintf(", release_file = %q", opts.ReleaseFile)
	}
	if opts.ReleaseDelayMs > 0 {
		health += fmt.Sprintf(", release_delay_ms = %d", opts.ReleaseDelayMs)
	}
	if opts.ExampleDevDir != "" {
		health += fmt.Sprintf(", dev_dir = %q", opts.ExampleDevDir)
	}
	for _, r := range [][2]string{
		{`driver_dir = "../target/release"`, fmt.Sprintf("driver_dir = %q", debug)},
		{`"target/release/libfake_nvml.so"`, fmt.Sprintf("%q", filepath.Join(debug, "libfake_nvml.so"))},
		{`"/dev/shm/devhost-demo-health"`, health},
	} {
		if !strings.Contains(text, r[0]) {
			t.Fatalf("config/demo.toml no longer contains %s: update tests/cluster/internal/devhost", r[0])
		}
		text = strings.Replace(text, r[0], r[1], 1)
	}
	if opts.SimDevfs != "" {
		for _, drv := range []string{"fpga", "tpu"} {
			from := fmt.Sprintf("devfs_root = %q", "config/sim/"+drv+"/dev")
			if !strings.Contains(text, from) {
				t.Fatalf("config/demo.toml no longer contains %s: update tests/cluster/internal/devhost", from)
			}
			text = strings.Replace(text, from, fmt.Sprintf("devfs_root = %q", filepath.Join(opts.SimDevfs, drv)), 1)
		}
	}
	if opts.ReleaseDelayMs > 0 {
		// The hook's delay must stay under the instance's call deadline (10 s by default).
		const table = "[driver.example_c]\n"
		if !strings.Contains(text, table) {
			t.Fatalf("config/demo.toml no longer contains %s: update tests/cluster/internal/devhost", table)
		}
		text = strings.Replace(text, table, table+"call_timeout = \"60s\"\n", 1)
	}
	if opts.NvidiaCDI {
		const strategy = `device_list_strategy = ["envvar", "device-nodes"]`
		if !strings.Contains(text, strategy) {
			t.Fatalf("config/demo.toml no longer contains %s: update tests/cluster/internal/devhost", strategy)
		}
		text = strings.Replace(text, strategy, `device_list_strategy = ["envvar", "cdi"]`, 1)
	} else if opts.CDIDir != "" {
		text = strings.ReplaceAll(text, "[[resource]]\n", "[[resource]]\ndevice_list_strategy = \"cdi\"\n")
	}
	podRes := opts.PodResourcesSocket
	if podRes == "" {
		podRes = filepath.Join(dir, "no-pod-resources.sock")
	}
	runtimeSock := opts.RuntimeSocket
	if runtimeSock == "" {
		runtimeSock = filepath.Join(dir, "no-runtime.sock")
	}
	head := fmt.Sprintf("kubelet_dir = %q\npod_resources_socket = %q\npod_resources_interval = \"500ms\"\nruntime_socket = %q\n",
		opts.KubeletDir, podRes, runtimeSock)
	// The default lock_dir, /run/devhost, is the machine's and shared by both test binaries
	// (go test runs packages at once): their devhosts, each on its own namespace's
	// /var/lib/kubelet/device-plugins, would take the same lock and one would exit. The
	// namespace's /var/lib is private (internal/nodens), so the lock is per test binary.
	head += "lock_dir = \"/var/lib/devhost-test-lock\"\n"
	if opts.CDIDir != "" {
		head += fmt.Sprintf("cdi_dir = %q\n", opts.CDIDir)
	}
	if opts.StateDir != "" {
		head += fmt.Sprintf("state_dir = %q\n", opts.StateDir)
	}
	if opts.MetricsAddr != "" {
		head += fmt.Sprintf("metrics_addr = %q\n", opts.MetricsAddr)
	}
	path := filepath.Join(dir, "devhost.toml")
	if err := os.WriteFile(path, []byte(head+text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// Process is a running `devhost run`.
type Process struct {
	Cmd  *exec.Cmd
	Log  string
	done chan error
}

// Start runs `devhost run --config config` from the repository root, logging to
// <log dir>/devhost-<n>.log; the log's tail is printed if the test fails (always with
// DEVHOST_TEST_LOG set). The process is stopped (SIGTERM) when the test ends, if it is
// still running.
func Start(t testing.TB, config string) *Process {
	t.Helper()
	logf, err := os.CreateTemp(filepath.Dir(config), "devhost-*.log")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(Bin(t), "run", "--config", config)
	cmd.Dir = Root()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), "DEVHOST_LOG=info,devhost::fronts::device_plugin::kubelet=debug")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &Process{Cmd: cmd, Log: logf.Name(), done: make(chan error, 1)}
	go func() { p.done <- cmd.Wait(); logf.Close() }()
	t.Cleanup(func() {
		p.Stop(t)
		if t.Failed() || os.Getenv("DEVHOST_TEST_LOG") != "" {
			data, _ := os.ReadFile(p.Log)
			lines := strings.Split(string(data), "\n")
			if len(lines) > 60 {
				lines = lines[len(lines)-60:]
			}
			t.Logf("devhost log %s (tail):\n%s", p.Log, strings.Join(lines, "\n"))
		}
	})
	return p
}

// Stop sends SIGTERM and waits up to 20 s for a clean exit (then kills it).
func (p *Process) Stop(t testing.TB) {
	if p.Cmd.ProcessState != nil {
		return
	}
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.done:
		if err != nil {
			t.Errorf("devhost exited with %v after SIGTERM", err)
		}
		p.done <- err
	case <-time.After(20 * time.Second):
		_ = p.Cmd.Process.Kill()
		t.Errorf("devhost did not exit within 20 s of SIGTERM")
	}
}

// Kill sends SIGKILL (a crash: no clean-up, sockets and the lock file left behind) and
// waits for the process to be gone.
func (p *Process) Kill(t testing.TB) {
	t.Helper()
	if p.Cmd.ProcessState != nil {
		return
	}
	_ = p.Cmd.Process.Kill()
	select {
	case err := <-p.done:
		p.done <- err
	case <-time.After(20 * time.Second):
		t.Fatalf("devhost (pid %d) still running 20 s after SIGKILL", p.Cmd.Process.Pid)
	}
}

// Resource is one entry of `devhost list --json`.
type Resource struct {
	Resource   string   `json:"resource"`
	Healthy    int      `json:"healthy"`
	Unhealthy  int      `json:"unhealthy"`
	Devices    []Device `json:"devices"`
	Registered bool     `json:"registered"`
}

// Device is one device of a Resource.
type Device struct {
	ID       string            `json:"id"`
	Health   string            `json:"health"`
	NUMANode *int              `json:"numa_node"`
	Attrs    map[string]string `json:"attributes"`
}

// List runs `devhost list --json --config config`.
func List(t testing.TB, config string) []Resource {
	t.Helper()
	cmd := exec.Command(Bin(t), "list", "--json", "--config", config)
	cmd.Dir = Root()
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("devhost list: %v\n%s", err, stderr.String())
	}
	var out []Resource
	if err := json.Unmarshal(stdout.Bytes(), &out); err != nil {
		t.Fatalf("devhost list --json: %v\n%s", err, stdout.String())
	}
	return out
}

// Eventually polls cond every 20 ms until it returns "" (success) or timeout passes, and
// fails the test with the last message. It returns how long it took.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() string) time.Duration {
	t.Helper()
	start := time.Now()
	last := ""
	for {
		if last = cond(); last == "" {
			return time.Since(start)
		}
		if time.Since(start) > timeout {
			t.Fatalf("%s: not within %v: %s", what, timeout, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestFiles makes, in dir, the health file a test's devhost reads (empty: every device
// healthy) and names the release record its release hook writes.
func TestFiles(t *testing.T, dir string) (health, release string) {
	t.Helper()
	health, release = filepath.Join(dir, "health"), filepath.Join(dir, "released")
	if err := os.WriteFile(health, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return health, release
}

// SimNode is one node of MakeSimDevfs's trees: its path below /dev and its major:minor.
type SimNode struct {
	Path         string
	Major, Minor uint32
}

// SimMajor is the character major of MakeSimDevfs's nodes: one no driver registers here (the
// kernel's range 240–254 is for local use, and this machine's drivers take theirs from 254
// down), so opening such a node reaches the kernel's lookup of its driver and fails with ENXIO
// ("No such device or address") when the device cgroup allows it, and with EPERM
// ("Operation not permitted") when the cgroup refuses it.
const SimMajor = 240

// MakeSimDevfs makes dir/fpga and dir/tpu: the demo's simulated devfs trees
// (config/sim/{fpga,tpu}/dev) with each plain file there made a character device of major
// SimMajor and minors 0, 1, … in the trees' order. It returns the nodes of each driver.
func MakeSimDevfs(t testing.TB, dir string) map[string][]SimNode {
	t.Helper()
	nodes := map[string][]SimNode{}
	minor := uint32(0)
	for _, drv := range []string{"fpga", "tpu"} {
		src := filepath.Join(Root(), "config", "sim", drv, "dev")
		err := filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			rel, err := filepath.Rel(src, path)
			if err != nil {
				return err
			}
			dst := filepath.Join(dir, drv, rel)
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return err
			}
			_ = os.Remove(dst)
			if err := syscall.Mknod(dst, syscall.S_IFCHR|0o666, Mkdev(SimMajor, minor)); err != nil {
				return fmt.Errorf("mknod %s: %w", dst, err)
			}
			nodes[drv] = append(nodes[drv], SimNode{Path: "/dev/" + rel, Major: SimMajor, Minor: minor})
			minor++
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return nodes
}

// Mkdev is the kernel's new_encode_dev: a device number as mknod(2) takes it.
func Mkdev(major, minor uint32) int {
	return int((minor & 0xff) | (major << 8) | ((minor &^ 0xff) << 12))
}

// Recap makes a failing test say last, after every other clean-up (the log tails Start
// prints), which step it was at and what it found wrong through the Recap (failures of
// helpers that take t are in the log above, at that step): CI shows the lines just before
// "--- FAIL", and a long log tail pushes the test's own messages out of them. Call it
// first in the test, so that its clean-up runs last.
type Recap struct {
	t     testing.TB
	step  string
	found []string
}

func NewRecap(t testing.TB) *Recap {
	r := &Recap{t: t, step: "start"}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("RECAP: failed at step %q; found: %s", r.step, strings.Join(r.found, " | "))
		}
	})
	return r
}

// Step names what the test does next.
func (r *Recap) Step(step string) { r.step = step }

// keep formats a failure and keeps it for the recap.
func (r *Recap) keep(format string, args ...any) string {
	msg := fmt.Sprintf(format, args...)
	r.found = append(r.found, msg)
	return msg
}

// Errorf is t.Errorf, kept for the recap.
func (r *Recap) Errorf(format string, args ...any) {
	r.t.Helper()
	r.t.Errorf("%s", r.keep(format, args...))
}

// Fatalf is t.Fatalf, kept for the recap.
func (r *Recap) Fatalf(format string, args ...any) {
	r.t.Helper()
	r.t.Fatalf("%s", r.keep(format, args...))
}

// Eventually is Eventually as a step of the recap.
func (r *Recap) Eventually(timeout time.Duration, what string, cond func() string) time.Duration {
	r.t.Helper()
	r.step = what
	return Eventually(recapTB{r.t, r}, timeout, what, cond)
}

// recapTB keeps an Eventually's failure for the recap.
type recapTB struct {
	testing.TB
	r *Recap
}

func (t recapTB) Fatalf(format string, args ...any) {
	t.TB.Helper()
	t.TB.Fatalf("%s", t.r.keep(format, args...))
}
