package cluster

import (
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// KCMControllers is what kube-controller-manager runs: the resourceclaim controller
// (ResourceClaimTemplate -> one ResourceClaim per pod, reservedFor kept, the allocation dropped
// once no pod uses it) and the garbage collector, which deletes a generated claim once its pod
// is gone (the claim's owner reference; the resourceclaim controller deletes it only for a pod
// that is still there and done), and the DaemonSet controller (devhost's own DaemonSet in
// containers/, its pods and rolling updates). The scheduler writes allocations and extended-resource claims
// itself; service accounts and namespaces are made by the tests; nothing else is needed, and
// fewer controllers start faster on a loaded machine.
const KCMControllers = "resourceclaim-controller,garbage-collector-controller,daemonset-controller"

// startControlPlane starts kube-scheduler and kube-controller-manager as cluster admin, with
// their HTTPS ports off (two clusters may run at once on one machine).
func (c *Cluster) startControlPlane() error {
	p, err := c.start("kube-scheduler", "--kubeconfig", c.AdminKubeconfig,
		"--leader-elect=false", "--secure-port=0", "--v=2")
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	p, err = c.start("kube-controller-manager", "--kubeconfig", c.AdminKubeconfig,
		"--leader-elect=false", "--secure-port=0", "--controllers", KCMControllers,
		"--service-account-private-key-file", filepath.Join(c.Dir, "sa.key"),
		"--root-ca-file", filepath.Join(c.Dir, "ca.crt"),
		"--v=2")
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	// Both read their flags and connect at once: an early exit (a flag this release does not
	// know, a refused gate) shows here rather than as a pod that never gets scheduled.
	time.Sleep(2 * time.Second)
	for _, p := range c.procs {
		if p.Exited() {
			return fmt.Errorf("%s exited at start", p.Name)
		}
	}
	return nil
}

// writeCA writes <dir>/ca.crt, the CA of the API server's self-signed certificate, after
// checking that the certificate names 127.0.0.1, which a verifying client (rustls) needs.
func (c *Cluster) writeCA() error {
	path := filepath.Join(c.Dir, "certs", "apiserver.crt")
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("the API server's certificate: %w", err)
	}
	var ca []byte
	var leaf *x509.Certificate
	for rest := data; ; {
		var block *pem.Block
		if block, rest = pem.Decode(rest); block == nil {
			break
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		if cert.IsCA {
			ca = pem.EncodeToMemory(block)
		} else if leaf == nil {
			leaf = cert
		}
	}
	if ca == nil || leaf == nil {
		return fmt.Errorf("%s: expected a serving certificate and its CA, found CA %v, leaf %v", path, ca != nil, leaf != nil)
	}
	names := false
	for _, ip := range leaf.IPAddresses {
		names = names || ip.Equal(net.IPv4(127, 0, 0, 1))
	}
	if !names {
		return fmt.Errorf("%s: the serving certificate's SANs are IPs %v, DNS %v: no 127.0.0.1, so devhost cannot verify it",
			path, leaf.IPAddresses, leaf.DNSNames)
	}
	return writeFile(filepath.Join(c.Dir, "ca.crt"), string(ca))
}

// TokenPod is the pod in kube-system, bound to the node, that devhost's token is bound to.
const TokenPod = "devhost-token-holder"

// writeDevhostKubeconfig makes the ServiceAccount kube-system/devhost, a pod of it on the node
// (TokenPod: it runs nothing on fakecri, the pause image on containerd) and a token bound to
// that pod (TokenRequest), so the token carries the node's name
// (`authentication.kubernetes.io/node-name`) as a DaemonSet pod's does; and writes
// <dir>/kubeconfig-devhost with it and the CA inline.
func (c *Cluster) writeDevhostKubeconfig() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const ns = "kube-system"
	if _, err := c.Client.CoreV1().ServiceAccounts(ns).Create(ctx,
		&v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "devhost"}}, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("ServiceAccount %s/devhost: %w", ns, err)
	}
	no := false
	// fakecri runs any image name; containerd has only the images the harness imported.
	image, pull := "devhost.test/pause:1", v1.PullIfNotPresent
	if c.Containerd != nil {
		image, pull = PauseImage, v1.PullNever
	}
	pod, err := c.Client.CoreV1().Pods(ns).Create(ctx, &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: TokenPod},
		Spec: v1.PodSpec{
			NodeName: NodeName, ServiceAccountName: "devhost", AutomountServiceAccountToken: &no,
			Containers: []v1.Container{{Name: "main", Image: image, ImagePullPolicy: pull}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("pod %s/%s: %w", ns, TokenPod, err)
	}
	day := int64(24 * 3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "devhost", &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		ExpirationSeconds: &day,
		BoundObjectRef:    &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("a token for %s/devhost: %w", ns, err)
	}
	ca, err := os.ReadFile(filepath.Join(c.Dir, "ca.crt"))
	if err != nil {
		return err
	}
	c.DevhostKubeconfig = filepath.Join(c.Dir, "kubeconfig-devhost")
	return writeFile(c.DevhostKubeconfig, fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: local, cluster: {server: "https://127.0.0.1:%d", certificate-authority-data: %s}}]
users: [{name: devhost, user: {token: %s}}]
contexts: [{name: local, context: {cluster: local, user: devhost, namespace: kube-system}}]
current-context: local
`, c.apiPort, base64.StdEncoding.EncodeToString(ca), tr.Status.Token))
}

// Scheduler and ControllerManager are those processes (nil without Options.ControlPlane).
func (c *Cluster) Scheduler() *Proc         { return c.proc("kube-scheduler") }
func (c *Cluster) ControllerManager() *Proc { return c.proc("kube-controller-manager") }

func (c *Cluster) proc(name string) *Proc {
	for _, p := range c.procs {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// KubeletLogLines is every line of the kubelet's log (all kubelets started so far, which
// append to one file) that contains each of the words.
func (c *Cluster) KubeletLogLines(words ...string) []string {
	return LinesWith(filepath.Join(c.Dir, "kubelet.log"), words...)
}

// untaintNode removes the node.kubernetes.io/not-ready taint the kubelet registers the Node
// with. The node lifecycle controller would remove it once the Node is Ready, but it also
// taints and evicts while a test's kubelet is down, so it does not run here.
func (c *Cluster) untaintNode() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	n, err := c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
	if err != nil {
		return err
	}
	var keep []v1.Taint
	for _, t := range n.Spec.Taints {
		if t.Key != v1.TaintNodeNotReady {
			keep = append(keep, t)
		}
	}
	if len(keep) == len(n.Spec.Taints) {
		return nil
	}
	n.Spec.Taints = keep
	_, err = c.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	return err
}
