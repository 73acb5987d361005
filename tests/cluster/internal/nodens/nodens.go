// Package nodens gives a test binary a private mount namespace, so that tests can use the
// kubelet's fixed paths (/var/lib/kubelet/...) without touching the machine's: the binary
// re-executes itself in a new mount namespace, mounts a tmpfs on /var/lib, /var/log and
// /run/devhost (devhost's lock folder) and, optionally, turns the simulated device files under config/sim into character devices
// (bind mounts of /dev/null) as a container runtime expects device nodes to be.
package nodens

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
)

const marker = "DEVHOST_TEST_MOUNT_NS"

// Enter is called first from TestMain. In the parent it runs the test binary again in a new
// mount namespace and exits with its status; in the child it prepares the mounts and returns.
// simDev lists folders (e.g. <repo>/config/sim) whose regular files under */dev become
// character devices for the child.
func Enter(simDev ...string) {
	if os.Getenv(marker) == "" {
		if os.Geteuid() != 0 {
			fmt.Fprintln(os.Stderr, "nodens: these tests need root (a mount namespace for /var/lib/kubelet)")
			os.Exit(1)
		}
		cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.Env = append(os.Environ(), marker+"=1")
		// Go makes "/" private (MS_REC|MS_PRIVATE) after unsharing CLONE_NEWNS.
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
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

func must(err error, what string) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "nodens: %s: %v\n", what, err)
		os.Exit(1)
	}
}
