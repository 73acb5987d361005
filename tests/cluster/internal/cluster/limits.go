package cluster

import (
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Limits turns counts of extended resources into a container's resource list.
func Limits(counts map[string]int64) v1.ResourceList {
	rl := v1.ResourceList{}
	for name, n := range counts {
		rl[v1.ResourceName(name)] = *resource.NewQuantity(n, resource.DecimalSI)
	}
	return rl
}
