//! What a parsed manifest is: the types the parser in `build` fills in and the rest of the host
//! reads, with their defaults. A leaf of the manifest: it uses none of its sibling files.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::names::glob_match;

/// Where the kubelet looks for device-plugin sockets unless the manifest says otherwise.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet/device-plugins";
/// The kubelet's root directory (`--root-dir`), home of `plugins_registry/` and `plugins/` where
/// DRA drivers are served, unless the manifest says otherwise.
pub const DEFAULT_KUBELET_ROOT_DIR: &str = "/var/lib/kubelet";
/// Where driver modules are looked up unless the manifest says otherwise.
pub const DEFAULT_DRIVER_DIR: &str = "/usr/lib/devhost/drivers";
/// Deadline of one driver call unless the manifest says otherwise.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Where the kubelet serves its PodResources API unless the manifest says otherwise.
/// The folders containerd and CRI-O read CDI specs from unless configured otherwise, in their
/// order: a spec in the later folder wins.
pub const DEFAULT_CDI_SPEC_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];
pub const DEFAULT_POD_RESOURCES_SOCKET: &str = devhost_proto::POD_RESOURCES_SOCKET;
/// containerd's CRI socket, the default `runtime_socket`.
pub const DEFAULT_RUNTIME_SOCKET: &str = devhost_proto::CONTAINERD_SOCKET;
/// How often the host asks the kubelet who holds which device unless the manifest says otherwise.
pub const DEFAULT_POD_RESOURCES_INTERVAL: Duration = Duration::from_secs(2);
/// How often each DRA driver looks for stale claims (besides once at its start) unless the
/// manifest says otherwise (`dra_claim_check_interval`).
pub const DEFAULT_DRA_CLAIM_CHECK_INTERVAL: Duration = Duration::from_secs(300);
/// Where the lock that keeps a second daemon off the same kubelet folder lives unless the
/// manifest says otherwise (outside the kubelet's folder, which the kubelet empties).
pub const DEFAULT_LOCK_DIR: &str = "/run/devhost";
/// Where the host keeps what must survive its restarts (the device release state) unless the
/// manifest says otherwise: on the host's disk, unlike `lock_dir`, so it outlives a reboot too.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/devhost";
/// Longest unix socket path (`sun_path` holds 108 bytes including the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// A parsed and validated manifest. Paths are already resolved against the manifest's folder.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// The file this manifest came from.
    pub path: PathBuf,
    /// Folder of the kubelet's device-plugin sockets (and of ours).
    pub kubelet_dir: PathBuf,
    /// Folder relative module paths and conventional module names are looked up in.
    pub driver_dir: PathBuf,
    /// The kubelet's root directory, under which DRA resources are served (`kubelet_root_dir`).
    pub kubelet_root_dir: PathBuf,
    /// The kubeconfig file DRA resources reach the API server with (`kubeconfig`); `None`: the
    /// pod's service account (in-cluster), else `$KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// This node's name as the API server knows it (`node_name`); `None`: `$NODE_NAME`, else
    /// the host name.
    pub node_name: Option<String>,
    /// How often each DRA driver checks its prepared claims against the API server and the
    /// kubelet, besides once at its start (`dra_claim_check_interval`).
    pub dra_claim_check_interval: Duration,
    /// Every driver instance: declared with `[driver.X]` and implicit (named only by a resource).
    pub drivers: BTreeMap<String, DriverConfig>,
    /// The `[[resource]]` entries, in file order.
    pub resources: Vec<ResourceConfig>,
    /// Things that are allowed but probably unintended, e.g. a driver no resource uses.
    pub warnings: Vec<String>,
    /// Load modules even when their file or folder is writable by others or owned by someone
    /// else (development only; logged loudly).
    pub allow_untrusted_modules: bool,
    /// Folder the host keeps one CDI spec file per resource in (`cdi_dir`); `None`: no CDI files.
    pub cdi_dir: Option<PathBuf>,
    /// The container runtime's CDI folders, in its order (the later wins), where every CDI name
    /// devhost hands out must resolve (`cdi_spec_dirs`).
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// Node Feature Discovery's `features.d` folder, where the host keeps its feature file
    /// (`nfd_features_dir`); `None`: no file.
    pub nfd_features_dir: Option<PathBuf>,
    /// Where `/metrics`, `/healthz`, `/readyz` and `/status` are served (`metrics_addr`).
    pub metrics_addr: Option<SocketAddr>,
    /// The kubelet's PodResources socket, asked who holds which device (`pod_resources_socket`).
    pub pod_resources_socket: PathBuf,
    /// How often that socket is asked, besides right after each Allocate (`pod_resources_interval`).
    pub pod_resources_interval: Duration,
    /// The container runtime's CRI socket, asked whether a device's last holder has exited
    /// before the driver's release hook runs (`runtime_socket`).
    pub runtime_socket: PathBuf,
    /// Folder of the lock file that allows one daemon per kubelet folder (`lock_dir`).
    pub lock_dir: PathBuf,
    /// Folder of the files that outlive a restart: which container held which device and which
    /// releases are pending (`state_dir`).
    pub state_dir: PathBuf,
    /// Per declared driver: each flattened option key and the `file:line:col` of its key, so
    /// that a driver's complaint about an option can point at it.
    pub option_locations: BTreeMap<String, Vec<(String, String)>>,
    /// Per implicit driver (named by a resource, with no `[driver.X]` table) whose name is
    /// close to a declared one: that one, offered when no module file is found.
    pub driver_hints: BTreeMap<String, DriverHint>,
}

/// One driver instance: a module plus the options it is created with.
#[derive(Debug, Clone, PartialEq)]
pub struct DriverConfig {
    /// The operator's name for the instance (the `X` of `[driver.X]`).
    pub name: String,
    /// Module files to try, in order; the loader uses the first that exists.
    pub module_candidates: Vec<PathBuf>,
    /// Options flattened to text key/value pairs, sorted by key.
    pub options: Vec<(String, String)>,
    /// How often the host rescans devices on its own; `None` leaves it to the driver's events.
    pub poll_interval: Option<Duration>,
    /// Deadline of one call into the driver.
    pub call_timeout: Duration,
    /// True when no `[driver.X]` table exists and the instance comes from a resource's `driver`.
    pub implicit: bool,
    /// Expected SHA-256 of the module file (lower-case hex), if pinned.
    pub sha256: Option<String>,
    /// Where the driver's code runs.
    pub isolation: Isolation,
}

/// Where a driver instance's code runs (`isolation` in `[driver.X]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Isolation {
    /// In the host process, on a driver thread of its own (`"in-process"`, an explicit opt-in:
    /// a crash in the driver's code ends the whole daemon).
    InProcess,
    /// In a worker process of its own (`"process"`, the default), which keeps only these
    /// capabilities (names as in capabilities(7), e.g. `CAP_SYS_ADMIN`; none by default).
    Process { keep_capabilities: Vec<String> },
}

impl Default for Isolation {
    /// Containment by default: a fault in vendor code costs that driver a restart.
    fn default() -> Self {
        Isolation::Process { keep_capabilities: Vec::new() }
    }
}

/// One extended resource advertised to the kubelet.
#[derive(Debug, Clone, PartialEq)]
pub struct ResourceConfig {
    /// The extended resource name, e.g. `nvidia.com/h100`.
    pub name: String,
    /// The driver instance whose devices feed this resource.
    pub driver: String,
    /// Attribute globs a device must all match (key `id` matches the device ID), sorted by key.
    pub matches: Vec<(String, String)>,
    /// File name of this resource's socket in `kubelet_dir`.
    pub socket_name: String,
    /// `file:line:column` of the `[[resource]]` entry, for messages about it.
    pub location: String,
    /// How many IDs each device is advertised as (`replicas`, 1 = no sharing).
    pub replicas: u32,
    /// Refuse a container request holding two replicas of one device.
    pub one_replica_per_container: bool,
    /// What Allocate answers with: raw container edits or CDI device names.
    pub device_list_strategy: DeviceListStrategy,
    /// The kubelet API that serves this resource (`api`, with `dra_driver`).
    pub api: ResourceApi,
    /// The effect of the taint an unhealthy device of a DRA resource carries in its slice
    /// (`dra_taint_effect`).
    pub dra_taint_effect: TaintEffect,
}

/// `dra_taint_effect` of a DRA resource: what the taint of an unhealthy device does to claims
/// that do not tolerate it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TaintEffect {
    /// New claims are not allocated the device; pods running with it stay (the default).
    #[default]
    NoSchedule,
    /// As NoSchedule, and the scheduler's eviction controller deletes the pods using it.
    NoExecute,
}

impl TaintEffect {
    /// The API's (and the manifest's) spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// `device_list_strategy` of a resource.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceListStrategy {
    /// Device nodes, mounts, env and annotations in the Allocate answer.
    #[default]
    Edits,
    /// CDI device names (and the CDI annotation) in the Allocate answer; needs `cdi_dir`.
    Cdi,
}

impl DeviceListStrategy {
    /// The manifest spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceListStrategy::Edits => "edits",
            DeviceListStrategy::Cdi => "cdi",
        }
    }
}

impl ResourceConfig {
    /// Equal in everything but where it is written: moving an entry in the
    /// file (a comment added above it) must not restart it on reload.
    pub fn same_settings(&self, other: &ResourceConfig) -> bool {
        ResourceConfig { location: String::new(), ..self.clone() }
            == ResourceConfig { location: String::new(), ..other.clone() }
    }

    /// Whether a device belongs to this resource: every `match` key must be an attribute of the
    /// device whose value matches the glob. The key `id` matches the device ID instead of an
    /// attribute. No `match` at all means every device of the driver.
    pub fn matches(&self, id: &str, attrs: &BTreeMap<String, String>) -> bool {
        self.matches.iter().all(|(key, pattern)| {
            let value = if key == "id" { Some(id) } else { attrs.get(key).map(String::as_str) };
            value.is_some_and(|value| glob_match(pattern, value))
        })
    }
}

/// One problem in a manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// `file:line:column` (1-based; the column counts characters). Just the file when the file
    /// itself could not be read.
    pub location: String,
    /// The key the problem is about, e.g. `resource[0].name` or `driver.nvidia.call_timeout`.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.location, self.field, self.message)
    }
}

/// Every problem found in a manifest, in file order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render_lines(.0))]
pub struct ManifestErrors(pub Vec<Diagnostic>);

fn render_lines(diagnostics: &[Diagnostic]) -> String {
    let lines: Vec<String> = diagnostics.iter().map(Diagnostic::to_string).collect();
    lines.join("\n")
}

/// The kubelet API a resource is served through (`api` in `[[resource]]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ResourceApi {
    /// An extended resource behind a device-plugin socket (`"device-plugin"`, the default).
    #[default]
    DevicePlugin,
    /// A DRA driver of this name with one pool per node (`"dra"`).
    Dra { driver_name: String },
}

impl ResourceApi {
    /// The manifest spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            ResourceApi::DevicePlugin => "device-plugin",
            ResourceApi::Dra { .. } => "dra",
        }
    }

    /// The DRA driver name, for a DRA resource.
    pub fn dra_driver(&self) -> Option<&str> {
        match self {
            ResourceApi::DevicePlugin => None,
            ResourceApi::Dra { driver_name } => Some(driver_name),
        }
    }
}

/// A resource whose `driver` may be a typo of a declared driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverHint {
    /// `file:line:col` of the resource's `driver` value.
    pub at: String,
    /// The declared driver with the nearest name, and where its table is.
    pub similar: String,
    pub similar_at: String,
}
