//go:build tools

// Package peer pins NVIDIA's k8s-device-plugin, the peer devhost-bench runs
// beside devhost (`devhost-bench peers`); nothing here is devhost's code.
package peer

import _ "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin"
