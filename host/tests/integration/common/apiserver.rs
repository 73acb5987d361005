//! A real control plane for the host's integration tests: etcd and kube-apiserver built by
//! `tests/cluster/build` (the release pinned in tests/cluster/go.mod), on free loopback ports,
//! in a temporary folder, with an admin kubeconfig (token auth, the API server's self-signed
//! certificate as the authority) and the built `kubectl` for test setup. It mirrors
//! tests/cluster/internal/cluster/cluster.go without the kubelet. A server that cannot start
//! fails the test with the tail of its log; it is never skipped.
//!
//! The processes are started from one long-lived thread with `PR_SET_PDEATHSIG`, so they die
//! with the test binary even when it is killed; [`Drop`] stops them and removes the folder.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long etcd plus kube-apiserver may take to answer /readyz (a loaded 2-core machine).
const READY_WITHIN: Duration = Duration::from_secs(180);
/// The admin's bearer token (in `tokens.csv`, group `system:masters`).
pub const ADMIN_TOKEN: &str = "admin-token";
/// A node's bearer token: user `system:node:devhost-node`, group `system:nodes`.
pub const NODE_TOKEN: &str = "node-token";
/// The node name of [`NODE_TOKEN`].
pub const NODE_NAME: &str = "devhost-node";

/// A running etcd and kube-apiserver.
pub struct ApiServerHarness {
    dir: Option<tempfile::TempDir>,
    root: PathBuf,
    bin: PathBuf,
    port: u16,
    kubeconfig: PathBuf,
    node_kubeconfig: PathBuf,
    procs: Vec<(&'static str, Child, PathBuf)>,
    /// kube-apiserver's arguments, to start it again after [`ApiServerHarness::stop_api_server`]
    /// (before the launch: the extra ones the test asked for).
    api_args: Vec<String>,
}

impl ApiServerHarness {
    /// Starts etcd and kube-apiserver and waits until /readyz answers through the admin
    /// kubeconfig. Panics, with the logs' tails, if they cannot start.
    pub fn start() -> ApiServerHarness {
        ApiServerHarness::start_with(&[])
    }

    /// [`ApiServerHarness::start`], with `extra` arguments for kube-apiserver (a feature gate
    /// off, say).
    pub fn start_with(extra: &[&str]) -> ApiServerHarness {
        let dir = tempfile::Builder::new().prefix("dh-apiserver").tempdir().expect("temporary folder");
        let root = dir.path().to_path_buf();
        ApiServerHarness::start_in(Some(dir), root, extra)
    }

    /// One harness per test binary, started on first use and shared by its tests (use distinct
    /// namespaces or names). It is never dropped: its processes end with the binary, and its
    /// folder (under Cargo's target tmp folder) is replaced by the next run.
    pub fn shared() -> &'static ApiServerHarness {
        static SHARED: OnceLock<ApiServerHarness> = OnceLock::new();
        SHARED.get_or_init(|| {
            let exe = std::env::current_exe().ok();
            let name = exe.as_deref().and_then(Path::file_stem).and_then(|s| s.to_str()).unwrap_or("tests");
            let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("apiserver-{name}"));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).expect("shared harness folder");
            ApiServerHarness::start_in(None, root, &[])
        })
    }

    fn start_in(dir: Option<tempfile::TempDir>, root: PathBuf, extra: &[&str]) -> ApiServerHarness {
        let bin = build_dir();
        let mut last = String::new();
        // A free port can be taken between our probe and the server's bind: try again then.
        for attempt in 0..3 {
            let run = root.join(format!("run{attempt}"));
            std::fs::create_dir_all(&run).expect("run folder");
            let mut h = ApiServerHarness {
                dir: None,
                root: run.clone(),
                bin: bin.clone(),
                port: 0,
                kubeconfig: run.join("kubeconfig-admin"),
                node_kubeconfig: run.join("kubeconfig-node"),
                procs: Vec::new(),
                api_args: extra.iter().map(|a| a.to_string()).collect(),
            };
            match h.launch() {
                Ok(()) => {
                    h.dir = dir;
                    return h;
                }
                Err(e) => {
                    last = format!("{e}\n{}", h.logs(40));
                    h.stop();
                    if !last.contains("address already in use") {
                        break;
                    }
                }
            }
        }
        panic!("the test API server did not start:\n{last}");
    }

    fn launch(&mut self) -> Result<(), String> {
        let dir = self.root.clone();
        let key = dir.join("sa.key");
        let public = dir.join("sa.pub");
        openssl(&["genrsa", "-out", path_str(&key), "2048"])?;
        openssl(&["rsa", "-in", path_str(&key), "-pubout", "-out", path_str(&public)])?;
        std::fs::write(
            dir.join("tokens.csv"),
            format!(
                "{ADMIN_TOKEN},admin,admin,\"system:masters\"\n{NODE_TOKEN},system:node:{NODE_NAME},node,\"system:nodes\"\n"
            ),
        )
        .map_err(|e| format!("tokens.csv: {e}"))?;
        let (etcd_port, peer_port, api_port) = (free_port(), free_port(), free_port());
        self.port = api_port;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let data = dir.join("etcd");
        self.spawn(
            "etcd",
            &[
                "--data-dir",
                path_str(&data),
                "--listen-client-urls",
                &etcd_url,
                "--advertise-client-urls",
                &etcd_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &format!("default={peer_url}"),
                "--unsafe-no-fsync",
            ],
        )?;
        let certs = dir.join("certs");
        let tokens = dir.join("tokens.csv");
        let port = api_port.to_string();
        let args: [&str; 24] = [
            "--etcd-servers",
            &etcd_url,
            "--bind-address",
            "127.0.0.1",
            "--advertise-address",
            "127.0.0.1",
            // No `kubernetes` Service endpoints (nothing here reads them); from 1.37 the default
            // reconciler refuses a loopback advertise address ("may not be in the loopback range").
            "--endpoint-reconciler-type",
            "none",
            "--secure-port",
            &port,
            "--cert-dir",
            path_str(&certs),
            "--service-account-issuer",
            "https://kubernetes.default.svc",
            "--service-account-key-file",
            path_str(&public),
            "--service-account-signing-key-file",
            path_str(&key),
            "--service-cluster-ip-range",
            "10.96.0.0/16",
            "--token-auth-file",
            path_str(&tokens),
            "--authorization-mode",
            "AlwaysAllow",
        ];
        let extra = std::mem::take(&mut self.api_args);
        self.api_args = args.iter().map(|a| a.to_string()).chain(extra).collect();
        let all: Vec<String> = self.api_args.clone();
        self.spawn("kube-apiserver", &all.iter().map(String::as_str).collect::<Vec<_>>())?;
        // The self-signed certificate is written before the server listens.
        let cert = certs.join("apiserver.crt");
        let deadline = Instant::now() + READY_WITHIN;
        while !cert.exists() {
            self.check_alive()?;
            if Instant::now() > deadline {
                return Err(format!("kube-apiserver wrote no {} within {READY_WITHIN:?}", cert.display()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_millis(200));
        let tls = if cert_has_loopback_ip(&cert) {
            format!("certificate-authority: {}", cert.display())
        } else {
            "insecure-skip-tls-verify: true".to_owned()
        };
        for (path, user, token) in
            [(&self.kubeconfig, "admin", ADMIN_TOKEN), (&self.node_kubeconfig, "node", NODE_TOKEN)]
        {
            let text = format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: https://127.0.0.1:{api_port}\n    {tls}\n\
                 users:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n- name: local\n  context:\n    cluster: local\n    user: {user}\n\
                 current-context: local\n"
            );
            std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        self.wait_ready(deadline)
    }

    /// Waits until /readyz answers "ok" through the admin kubeconfig.
    fn wait_ready(&mut self, deadline: Instant) -> Result<(), String> {
        loop {
            self.check_alive()?;
            let out = self.kubectl_output(&["get", "--raw", "/readyz"], None);
            if matches!(&out, Ok(body) if body.trim() == "ok") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("kube-apiserver not ready within {READY_WITHIN:?}: last answer {out:?}"));
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Stops kube-apiserver (SIGTERM, then SIGKILL after 10 s), leaving etcd and the folder: its
    /// port refuses connections until [`ApiServerHarness::start_api_server`].
    pub fn stop_api_server(&mut self) {
        if let Some(i) = self.procs.iter().position(|(name, ..)| *name == "kube-apiserver") {
            let (_, child, _) = self.procs.remove(i);
            end(child);
        }
    }

    /// Starts kube-apiserver again with its first arguments (same port, certificate and
    /// tokens, so every kubeconfig stays valid) and waits until it is ready.
    pub fn start_api_server(&mut self) {
        assert!(self.procs.iter().all(|(name, ..)| *name != "kube-apiserver"), "kube-apiserver is running");
        let args = self.api_args.clone();
        let started = self
            .spawn("kube-apiserver", &args.iter().map(String::as_str).collect::<Vec<_>>())
            .and_then(|()| self.wait_ready(Instant::now() + READY_WITHIN));
        if let Err(e) = started {
            panic!("kube-apiserver did not start again: {e}\n{}", self.logs(40));
        }
    }

    fn spawn(&mut self, name: &'static str, args: &[&str]) -> Result<(), String> {
        let log = self.root.join(format!("{name}.log"));
        // Appended to: a restarted server's log follows its earlier run's.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let err = file.try_clone().map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(self.bin.join(name));
        cmd.args(args).current_dir(&self.root).stdin(Stdio::null()).stdout(file).stderr(err);
        let child = spawn_tied(cmd).map_err(|e| format!("starting {}: {e}", self.bin.join(name).display()))?;
        self.procs.push((name, child, log));
        Ok(())
    }

    fn check_alive(&mut self) -> Result<(), String> {
        for (name, child, _) in &mut self.procs {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("{name} exited ({status})"));
            }
        }
        Ok(())
    }

    /// The admin kubeconfig (`system:masters`).
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A kubeconfig of the node identity `system:node:devhost-node` (authorization is
    /// AlwaysAllow, so it only changes who the server says the caller is).
    pub fn node_kubeconfig(&self) -> &Path {
        &self.node_kubeconfig
    }

    /// Creates ResourceClaim `name` in `ns` (one request `gpu` of DeviceClass `driver`) and
    /// writes its allocation of `pool`'s `device`, as the scheduler would; returns its UID.
    pub fn allocated_claim(&self, ns: &str, name: &str, driver: &str, pool: &str, device: &str) -> String {
        let yaml = format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: {ns}}}\n\
             spec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {{deviceClassName: {driver}}}\n"
        );
        self.kubectl_stdin(&["create", "-f", "-"], &yaml);
        let results = serde_json::json!([{"request": "gpu", "driver": driver, "pool": pool, "device": device}]);
        let patch = serde_json::json!({"status": {"allocation": {"devices": {"results": results}}}}).to_string();
        let status = ["patch", "resourceclaim", name, "-n", ns, "--subresource=status", "--type=merge", "-p", &patch];
        self.kubectl(&status);
        self.kubectl(&["get", "resourceclaim", name, "-n", ns, "-o", "jsonpath={.metadata.uid}"])
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The folder of the built binaries (kubectl, kube-apiserver, etcd, kubelet, fakecri).
    pub fn bin_dir(&self) -> &Path {
        &self.bin
    }

    /// Runs kubectl as the admin and returns its stdout; panics with its stderr if it fails.
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.kubectl_output(args, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs kubectl as the admin with `stdin` as its input (e.g. `apply -f -`).
    pub fn kubectl_stdin(&self, args: &[&str], stdin: &str) -> String {
        self.kubectl_output(args, Some(stdin)).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs kubectl as the admin: stdout, or an error with its stderr.
    pub fn kubectl_output(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        let mut cmd = Command::new(self.bin.join("kubectl"));
        cmd.arg("--kubeconfig").arg(&self.kubeconfig).args(args);
        cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(|e| format!("kubectl: {e}"))?;
        if let Some(text) = stdin {
            let mut pipe = child.stdin.take().expect("piped stdin");
            pipe.write_all(text.as_bytes()).map_err(|e| format!("kubectl stdin: {e}"))?;
        }
        let out = child.wait_with_output().map_err(|e| format!("kubectl: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!("kubectl {}: {}: {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr)))
        }
    }

    /// The last `n` lines of each process's log.
    pub fn logs(&self, n: usize) -> String {
        let mut text = String::new();
        for (name, _, log) in &self.procs {
            let body = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = body.lines().collect();
            let tail = lines[lines.len().saturating_sub(n)..].join("\n");
            text.push_str(&format!("--- {name} ({}) ---\n{tail}\n", log.display()));
        }
        text
    }

    fn stop(&mut self) {
        // The API server first, then etcd.
        while let Some((_, child, _)) = self.procs.pop() {
            end(child);
        }
    }
}

/// SIGTERM, up to 10 s for the exit, then SIGKILL.
fn end(mut child: Child) {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(child.try_wait(), Ok(Some(_))) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for ApiServerHarness {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The folder `tests/cluster/build` prints (it builds on first use, then answers at once).
fn build_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/cluster/build");
        let out = Command::new(&script)
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(out.status.success(), "{} failed ({}): see its output above", script.display(), out.status);
        let text = String::from_utf8_lossy(&out.stdout);
        let dir = PathBuf::from(text.lines().last().unwrap_or_default().trim());
        assert!(
            dir.join("kube-apiserver").exists(),
            "{} printed {text:?}, which has no kube-apiserver",
            script.display()
        );
        dir
    })
    .clone()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free loopback port").port()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("test paths are UTF-8")
}

fn openssl(args: &[&str]) -> Result<(), String> {
    let out = Command::new("openssl").args(args).output().map_err(|e| format!("cannot run openssl: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr)))
    }
}

/// Whether the certificate's subject alternative names hold 127.0.0.1 (the kubeconfig's server).
fn cert_has_loopback_ip(cert: &Path) -> bool {
    let out = Command::new("openssl").args(["x509", "-noout", "-text", "-in", path_str(cert)]).output();
    out.is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("IP Address:127.0.0.1"))
}

type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Spawns `cmd` from one thread that lives as long as the test binary, with
/// `PR_SET_PDEATHSIG` = SIGKILL: the signal follows the spawning thread's exit, and test
/// threads end after each test.
fn spawn_tied(cmd: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("apiserver-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    use std::os::unix::process::CommandExt;
                    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
                    unsafe {
                        cmd.pre_exec(|| {
                            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                            Ok(())
                        });
                    }
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawner thread");
        Mutex::new(tx)
    });
    let (tx, rx) = mpsc::channel();
    spawner.lock().unwrap_or_else(|p| p.into_inner()).send((cmd, tx)).expect("spawner thread alive");
    rx.recv().expect("spawner thread answers")
}
