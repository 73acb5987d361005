// Package cluster starts a one-node Kubernetes from the real components that tests/cluster/build
// makes: etcd, kube-apiserver, the kubelet's fake CRI runtime (fakecri) and the kubelet, all on
// loopback and unix sockets under one temporary folder; with Options.Containerd a real
// container runtime (containerd and runc, from tests/cluster/build-runtime) instead of fakecri; with Options.ControlPlane also
// kube-scheduler and kube-controller-manager (what Dynamic Resource Allocation needs), and with
// Options.RBAC the API server authorizes with Node,RBAC instead of AlwaysAllow. The kubelet's root folder is
// /var/lib/kubelet, which the test binary has made a private tmpfs (internal/nodens): the
// kubelet's device manager always uses /var/lib/kubelet/device-plugins, whatever --root-dir says.
package cluster

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"crypto/tls"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// NodeName is the name the kubelet registers.
const NodeName = "devhost-node"

// RootDir is the kubelet's --root-dir.
const RootDir = "/var/lib/kubelet"

// PodResourcesSocket is the kubelet's PodResources socket under RootDir.
const PodResourcesSocket = RootDir + "/pod-resources/kubelet.sock"

// DevhostUser is the identity devhost's kubeconfig (Cluster.DevhostKubeconfig) authenticates
// as: the ServiceAccount `devhost` in `kube-system`, as a token of a pod of the DaemonSet would.
const DevhostUser = "system:serviceaccount:kube-system:devhost"

// Options choose what runs besides etcd, the API server, fakecri and the kubelet.
type Options struct {
	// ControlPlane starts kube-scheduler and kube-controller-manager (its resourceclaim
	// controller only): pods are then scheduled, and ResourceClaimTemplates become claims.
	ControlPlane bool
	// RBAC makes the API server authorize with Node,RBAC (and admit with NodeRestriction):
	// the admin is in system:masters, the kubelet is system:node:<NodeName>, and devhost's
	// token (Cluster.DevhostKubeconfig) is DevhostUser's, which has only the rights RBAC
	// objects give it. Without RBAC every request is allowed (AlwaysAllow).
	RBAC bool
	// Containerd runs pods in real containers: containerd 2.x, runc and the CNI bridge plugin
	// (tests/cluster/build-runtime) instead of fakecri. The test binary must have entered
	// nodens.EnterNode (its own network namespace, the CDI folders as tmpfs).
	Containerd bool
}

// Cluster is a running etcd, kube-apiserver, fakecri and kubelet (and, with
// Options.ControlPlane, kube-scheduler and kube-controller-manager).
type Cluster struct {
	Bin, Dir string
	// KubeletBin is the folder whose kubelet runs: $DEVHOST_KUBELET_BIN (the version-skew runs'
	// older kubelet, tests/cluster/build --skew) when set, else Bin.
	KubeletBin      string
	Client          *kubernetes.Clientset
	AdminKubeconfig string
	// DevhostKubeconfig (with Options.RBAC) is a kubeconfig for devhost: a token of DevhostUser
	// bound to a pod on the node, as a DaemonSet pod's token is, and the API server's own CA
	// (certificate-authority-data), so that a client verifies its certificate.
	DevhostKubeconfig string
	RecordDir         string // fakecri's CreateContainer records
	// StaticPodDir is the kubelet's staticPodPath: a pod manifest written there runs as a static
	// pod, and removing the file ends it (checked every second).
	StaticPodDir string
	// Containerd is the real runtime (Options.Containerd), nil with fakecri.
	Containerd *Containerd
	apiPort    int
	kubelet    *Proc
	procs      []*Proc
}

// Proc is one component process.
type Proc struct {
	Name string
	Cmd  *exec.Cmd
	Log  string
	done chan struct{}
}

func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func (c *Cluster) start(name string, args ...string) (*Proc, error) {
	return c.startFrom(c.Bin, name, nil, args...)
}

// startFrom starts binDir/name with extra environment variables (KEY=VALUE) added.
func (c *Cluster) startFrom(binDir, name string, env []string, args ...string) (*Proc, error) {
	logPath := filepath.Join(c.Dir, name+".log")
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	bin := filepath.Join(binDir, name)
	cmd := exec.Command(bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout, cmd.Stderr = f, f
	// Never the test's package folder: see fakecri's log path.
	cmd.Dir = c.Dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	p := &Proc{Name: name, Cmd: cmd, Log: logPath, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); f.Close(); close(p.done) }()
	return p, nil
}

// Exited reports whether the process has ended.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop sends sig and waits up to 20 s, then kills.
func (p *Proc) Stop(sig syscall.Signal) {
	if p.Exited() {
		return
	}
	_ = p.Cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		_ = p.Cmd.Process.Kill()
		<-p.done
	}
}

// Tail is the last n lines of the process's log.
func (p *Proc) Tail(n int) string {
	data, _ := os.ReadFile(p.Log)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func writeFile(path, text string) error { return os.WriteFile(path, []byte(text), 0o600) }

// Start brings the cluster up and waits until the Node is Ready; on error everything started
// is stopped again.
func Start(bin, dir string) (c *Cluster, err error) { return StartWith(bin, dir, Options{}) }

// StartWith is Start with the components and authorization opts choose.
func StartWith(bin, dir string, opts Options) (_ *Cluster, err error) {
	// Not the named result: every `return nil, err` below would make it nil before the cleanup
	// runs, which then could neither print the components' logs nor stop them.
	kubeletBin := os.Getenv("DEVHOST_KUBELET_BIN")
	if kubeletBin == "" {
		kubeletBin = bin
	}
	c := &Cluster{Bin: bin, KubeletBin: kubeletBin, Dir: dir, RecordDir: filepath.Join(dir, "containers"), StaticPodDir: filepath.Join(dir, "static-pods")}
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w\n%s", err, c.Logs(30))
			c.Stop()
		}
	}()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	pub, _ := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err := writeFile(filepath.Join(dir, "sa.key"), string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))); err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(dir, "sa.pub"), string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}))); err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(dir, "tokens.csv"),
		"admin-token,admin,admin,\"system:masters\"\nnode-token,system:node:"+NodeName+",node,\"system:nodes\"\n"); err != nil {
		return nil, err
	}
	etcdPort, peerPort := freePort(), freePort()
	c.apiPort = freePort()
	for _, u := range [][2]string{{"admin", "admin-token"}, {"node", "node-token"}} {
		kc := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: local, cluster: {server: "https://127.0.0.1:%d", insecure-skip-tls-verify: true}}]
users: [{name: %s, user: {token: %s}}]
contexts: [{name: local, context: {cluster: local, user: %s}}]
current-context: local
`, c.apiPort, u[0], u[1], u[0])
		if err := writeFile(filepath.Join(dir, "kubeconfig-"+u[0]), kc); err != nil {
			return nil, err
		}
	}
	c.AdminKubeconfig = filepath.Join(dir, "kubeconfig-admin")

	authz, admission := "AlwaysAllow", []string(nil)
	if opts.RBAC {
		authz, admission = "Node,RBAC", []string{"--enable-admission-plugins", "NodeRestriction"}
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	p, err := c.start("etcd", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peerPort),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", peerPort),
		"--initial-cluster", fmt.Sprintf("default=http://127.0.0.1:%d", peerPort),
		"--unsafe-no-fsync")
	if err != nil {
		return nil, err
	}
	c.procs = append(c.procs, p)
	p, err = c.start("kube-apiserver", append([]string{"--etcd-servers", etcdURL,
		"--bind-address", "127.0.0.1", "--secure-port", fmt.Sprint(c.apiPort),
		"--cert-dir", filepath.Join(dir, "certs"),
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", filepath.Join(dir, "sa.pub"),
		"--service-account-signing-key-file", filepath.Join(dir, "sa.key"),
		"--service-cluster-ip-range", "10.96.0.0/16",
		"--token-auth-file", filepath.Join(dir, "tokens.csv"),
		"--authorization-mode", authz}, admission...)...)
	if err != nil {
		return nil, err
	}
	c.procs = append(c.procs, p)
	criSock := filepath.Join(dir, "cri.sock")
	if opts.Containerd {
		if criSock, err = c.startContainerd(); err != nil {
			return nil, err
		}
	} else {
		p, err = c.start("fakecri", "--endpoint", "unix://"+criSock, "--record-dir", c.RecordDir)
		if err != nil {
			return nil, err
		}
		c.procs = append(c.procs, p)
	}
	if err := c.waitAPIServer(90 * time.Second); err != nil {
		return nil, err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", c.AdminKubeconfig)
	if err != nil {
		return nil, err
	}
	if c.Client, err = kubernetes.NewForConfig(cfg); err != nil {
		return nil, err
	}
	if err := c.writeCA(); err != nil {
		return nil, err
	}
	if opts.ControlPlane {
		if err := c.startControlPlane(); err != nil {
			return nil, err
		}
	}
	kubeletPort, healthzPort := freePort(), freePort()
	if err := os.MkdirAll(c.StaticPodDir, 0o755); err != nil {
		return nil, err
	}
	if err := writeFile(filepath.Join(dir, "kubelet.yaml"), fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# cgroup v1 hosts: allowed again (1.35+ refuses them by default)
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://%[1]s
imageServiceEndpoint: unix://%[1]s
address: 127.0.0.1
port: %[2]d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %[3]d
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
# Node status every second, so that capacity changes reach the Node quickly.
nodeStatusUpdateFrequency: 1s
resolvConf: ""
staticPodPath: %[4]s
fileCheckFrequency: 1s
# The tests share the machine's disk with whatever else runs there: no eviction for disk space
# (the defaults evict every pod once less than 10–15 %% of the disk is free: "The node had
# condition: [DiskPressure]") and no image GC (the test images are imported once). "0%%"
# switches a signal off; memory.available keeps its default.
evictionHard: {memory.available: 100Mi, nodefs.available: "0%%", nodefs.inodesFree: "0%%", imagefs.available: "0%%", imagefs.inodesFree: "0%%"}
imageGCHighThresholdPercent: 100
`, criSock, kubeletPort, healthzPort, c.StaticPodDir)); err != nil {
		return nil, err
	}
	if err := c.StartKubelet(); err != nil {
		return nil, err
	}
	if err := c.WaitNodeReady(120 * time.Second); err != nil {
		return nil, err
	}
	if opts.ControlPlane {
		if err := c.untaintNode(); err != nil {
			return nil, err
		}
	}
	if opts.RBAC {
		if err := c.writeDevhostKubeconfig(); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// StartKubelet starts the kubelet (again).
func (c *Cluster) StartKubelet() error {
	p, err := c.startFrom(c.KubeletBin, "kubelet", nil, "--config", filepath.Join(c.Dir, "kubelet.yaml"),
		"--kubeconfig", filepath.Join(c.Dir, "kubeconfig-node"),
		"--root-dir", RootDir, "--hostname-override", NodeName,
		// The flags of the reference note: no QoS cgroups, no node allocatable enforcement, swap allowed.
		"--cgroups-per-qos=false", "--enforce-node-allocatable=", "--fail-swap-on=false",
		"--v=2")
	if err != nil {
		return err
	}
	c.kubelet = p
	return nil
}

// Kubelet is the kubelet process now running.
func (c *Cluster) Kubelet() *Proc { return c.kubelet }

func (c *Cluster) waitAPIServer(timeout time.Duration) error {
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		req, _ := http.NewRequest("GET", fmt.Sprintf("https://127.0.0.1:%d/readyz", c.apiPort), nil)
		req.Header.Set("Authorization", "Bearer admin-token")
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
		}
		for _, p := range c.procs {
			if p.Exited() {
				return fmt.Errorf("%s exited", p.Name)
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("kube-apiserver not ready within %v", timeout)
}

// Kubectl runs the built kubectl as cluster admin and returns its stdout.
func (c *Cluster) Kubectl(args ...string) ([]byte, error) {
	cmd := exec.Command(filepath.Join(c.Bin, "kubectl"), append([]string{"--kubeconfig", c.AdminKubeconfig}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, stderr.String())
	}
	return out, nil
}

// Logs is the tail of every component's log.
func (c *Cluster) Logs(n int) string {
	var b strings.Builder
	all := append([]*Proc(nil), c.procs...)
	if c.kubelet != nil {
		all = append(all, c.kubelet)
	}
	for _, p := range all {
		fmt.Fprintf(&b, "--- %s (%s) ---\n%s\n", p.Name, p.Log, p.Tail(n))
	}
	return b.String()
}

// Stop ends every component, the kubelet first, and with containerd every container it ran.
func (c *Cluster) Stop() {
	if c.kubelet != nil {
		c.kubelet.Stop(syscall.SIGTERM)
	}
	if c.Containerd != nil {
		c.Containerd.removeContainers()
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].Stop(syscall.SIGTERM)
	}
}
