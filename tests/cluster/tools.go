//go:build tools

// Package cluster pins the upstream mains that tests/cluster/build compiles, so that
// `go mod tidy` keeps them (and their exact versions) in go.mod and go.sum.
package cluster

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
