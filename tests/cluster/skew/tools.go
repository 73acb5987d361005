//go:build tools

// Package skew only names what `tests/cluster/build --skew` builds, so that go.mod and go.sum
// pin its dependencies.
package skew

import _ "k8s.io/kubernetes/cmd/kubelet"
