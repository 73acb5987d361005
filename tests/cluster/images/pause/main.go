// Command pause is the process that holds a test pod's sandbox (its namespaces) open, as the
// pause image of a real cluster does: it waits, reaps the zombies of a shared PID namespace, and
// exits 0 on SIGINT or SIGTERM. Built static (CGO_ENABLED=0) into an image of its own by
// tests/cluster/build-runtime, since no image can be pulled here.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sig := make(chan os.Signal, 8)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sig {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
