// Package nodens gives a test binary a private mount namespace, so that tests can use the
// kubelet's fixed paths (/var/lib/kubelet/...) without touching the machine's: the binary
// re-executes itself in a new mount namespace, mounts a tmpfs on /var/lib, /var/log and
// /run/devhost (devhost's lock folder) and, optionally, turns the simulated device files under config/sim into character devices
// (bind mounts of /dev/null) as a container runtime expects device nodes to be. EnterNode also
// gives it a network namespace of its own, for a kubelet and container runtime that change the
// node's network and kernel settings (see EnterNode).
package nodens

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

const marker = "DEVHOST_TEST_MOUNT_NS"

// Enter is called first from TestMain. In the parent it runs the test binary again in a new
// mount namespace and exits with its status; in the child it prepares the mounts and returns.
// simDev lists folders (e.g. <repo>/config/sim) whose regular files under */dev become
// character devices for the child.
func Enter(simDev ...string) { enter(false, simDev) }

// EnterNode is Enter for a test binary that runs a real container runtime: the binary also gets
// a network namespace of its own (loopback up; the CNI plugins add their bridge there, and
// every component listens on its loopback), and the kernel settings the kubelet sets at start
// (vm.overcommit_memory, vm.panic_on_oom, kernel.panic, kernel.panic_on_oops; not namespaced)
// are files of the namespace's own, so a test never changes the machine it runs on; /etc/cdi and
// /run/cdi (= /var/run/cdi), the CDI folders a runtime reads by default, and /run/udev are tmpfs
// mounts.
func EnterNode(simDev ...string) { enter(true, simDev) }

// The kernel settings the kubelet writes at start (its container manager's kernel tunables).
var kubeletSysctls = []string{"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops"}

func enter(node bool, simDev []string) {
	if os.Getenv(marker) == "" {
		if os.Geteuid() != 0 {
			fmt.Fprintln(os.Stderr, "nodens: these tests need root (a mount namespace for /var/lib/kubelet)")
			os.Exit(1)
		}
		cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.Env = append(os.Environ(), marker+"=1")
		// Go makes "/" private (MS_REC|MS_PRIVATE) after unsharing CLONE_NEWNS.
		flags := uintptr(syscall.CLONE_NEWNS)
		if node {
			flags |= syscall.CLONE_NEWNET
		}
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: flags, Pdeathsig: syscall.SIGKILL}
		err := cmd.Run()
		if exit, ok := err.(*exec.ExitError); ok {
			os.Exit(exit.ExitCode())
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "nodens: re-running the tests in a mount namespace: %v\n", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	// /var/lib for the kubelet's folders, /var/log for its pod logs.
	must(syscall.Mount("devhost-test", "/var/lib", "tmpfs", 0, "mode=0755"), "mount tmpfs on /var/lib")
	must(syscall.Mount("devhost-test", "/var/log", "tmpfs", 0, "mode=0755"), "mount tmpfs on /var/log")
	// devhost's lock_dir default: the lock there is per kubelet folder path, and every test
	// binary (and any devhost on the machine) uses the same /var/lib/kubelet/device-plugins,
	// so each binary gets a /run/devhost of its own. (state_dir, /var/lib/devhost, is under
	// the tmpfs above already.)
	must(os.MkdirAll("/run/devhost", 0o755), "mkdir /run/devhost")
	must(syscall.Mount("devhost-test", "/run/devhost", "tmpfs", 0, "mode=0755"), "mount tmpfs on /run/devhost")
	must(os.MkdirAll("/var/lib/kubelet/device-plugins", 0o750), "mkdir /var/lib/kubelet/device-plugins")
	must(os.MkdirAll("/var/lib/kubelet/pod-resources", 0o750), "mkdir /var/lib/kubelet/pod-resources")
	if node {
		enterNode()
	}
	for _, root := range simDev {
		devs, _ := filepath.Glob(filepath.Join(root, "*", "dev"))
		for _, dev := range devs {
			err := filepath.WalkDir(dev, func(path string, d fs.DirEntry, err error) error {
				if err != nil || !d.Type().IsRegular() {
					return err
				}
				return syscall.Mount("/dev/null", path, "", syscall.MS_BIND, "")
			})
			must(err, "bind /dev/null over the simulated device files in "+dev)
		}
	}
}

// nodeAddress is the node's address in its own network namespace, on an empty bridge that
// holds the default route (the API server and the kubelet look for one to find their address):
// TEST-NET-1, which is never routed anywhere, and nothing is sent there.
const nodeAddress = "192.0.2.10/24"

// NodeName is the node's name, which /etc/hosts of the namespace resolves to nodeAddress (the
// cluster package's NodeName; nodens cannot import it).
const NodeName = "devhost-node"

// enterNode brings the new network namespace's loopback up, gives it an interface with
// the default route, and puts a file of this namespace's own over each kernel setting the
// kubelet writes (/var/lib is the tmpfs mounted above).
func enterNode() {
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"link", "add", "node0", "type", "bridge"},
		{"addr", "add", nodeAddress, "dev", "node0"},
		{"link", "set", "node0", "up"},
		{"route", "add", "default", "dev", "node0"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			must(fmt.Errorf("%v: %s", err, out), "ip "+strings.Join(args, " "))
		}
	}
	must(os.MkdirAll("/var/lib/devhost-test-sysctl", 0o755), "mkdir /var/lib/devhost-test-sysctl")
	for _, name := range kubeletSysctls {
		path := "/proc/sys/" + name
		value, err := os.ReadFile(path)
		must(err, "read "+path)
		own := filepath.Join("/var/lib/devhost-test-sysctl", filepath.Base(name))
		must(os.WriteFile(own, value, 0o644), "write "+own)
		must(syscall.Mount(own, path, "", syscall.MS_BIND, ""), "bind a file over "+path)
	}
	// Name resolution of the namespace's own: the node's name (the kubelet's --hostname-override)
	// at its address, and a resolver on loopback, where nothing answers. The machine's resolver
	// is unreachable from here: each lookup the kubelet made of its node's name waited for DNS
	// time-outs, and the Node registered only after about 2.5 minutes.
	for name, text := range map[string]string{
		"hosts":       "127.0.0.1 localhost\n" + strings.Split(nodeAddress, "/")[0] + " " + NodeName + "\n",
		"resolv.conf": "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n",
	} {
		own := filepath.Join("/var/lib/devhost-test-sysctl", name)
		must(os.WriteFile(own, []byte(text), 0o644), "write "+own)
		must(syscall.Mount(own, "/etc/"+name, "", syscall.MS_BIND, ""), "bind a file over /etc/"+name)
	}
	// The CDI folders a container runtime reads by default, empty and the namespace's own, and
	// udev's database folder, which devhost's DaemonSet mounts (creating it if missing).
	for _, dir := range []string{"/etc/cdi", "/run/cdi", "/run/udev"} {
		must(os.MkdirAll(dir, 0o755), "mkdir "+dir)
		must(syscall.Mount("devhost-test", dir, "tmpfs", 0, "mode=0755"), "mount tmpfs on "+dir)
	}
}

func must(err error, what string) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "nodens: %s: %v\n", what, err)
		os.Exit(1)
	}
}
