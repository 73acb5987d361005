//! From manifest text to a [`Manifest`]: parse the TOML (keeping spans), deserialise each section
//! into its raw serde shape, then check what serde cannot (names, globs, socket path lengths,
//! duplicates) and resolve paths. Every problem lands in one [`Diagnostics`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde::de::IgnoredAny;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

use super::features;
use super::model::DeviceListStrategy;
use super::names::{check_driver_name, check_resource_name, socket_name};
use super::pod_resources;
use super::source::{Diagnostics, deserialize_section};
use super::values::{DurationSetting, flatten_options};
use crate::manifest::capabilities::capability_number;

use super::model::{
    DEFAULT_CALL_TIMEOUT, DEFAULT_DRA_CLAIM_CHECK_INTERVAL, DEFAULT_DRIVER_DIR, DEFAULT_KUBELET_DIR, DEFAULT_LOCK_DIR,
    DEFAULT_POD_RESOURCES_INTERVAL, DEFAULT_STATE_DIR, Diagnostic, DriverConfig, Isolation, MAX_SOCKET_PATH, Manifest,
    ManifestErrors, ResourceConfig,
};

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTop {
    kubelet_dir: Option<Spanned<String>>,
    driver_dir: Option<Spanned<String>>,
    kubelet_root_dir: Option<Spanned<String>>,
    kubeconfig: Option<Spanned<String>>,
    node_name: Option<Spanned<String>>,
    dra_claim_check_interval: Option<DurationSetting>,
    call_timeout: Option<DurationSetting>,
    allow_untrusted_modules: Option<bool>,
    cdi_dir: Option<Spanned<String>>,
    cdi_spec_dirs: Option<Spanned<Vec<Spanned<String>>>>,
    nfd_features_dir: Option<Spanned<String>>,
    metrics_addr: Option<Spanned<String>>,
    pod_resources_socket: Option<Spanned<String>>,
    pod_resources_interval: Option<DurationSetting>,
    runtime_socket: Option<Spanned<String>>,
    lock_dir: Option<Spanned<String>>,
    state_dir: Option<Spanned<String>>,
    // Walked separately, entry by entry, so one bad entry does not hide the others; listed here
    // so that unknown-key messages name them.
    #[serde(rename = "driver")]
    _driver: Option<IgnoredAny>,
    #[serde(rename = "resource")]
    _resource: Option<IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDriver {
    module: Option<Spanned<String>>,
    poll_interval: Option<DurationSetting>,
    call_timeout: Option<DurationSetting>,
    options: Option<Spanned<toml::Table>>,
    sha256: Option<Spanned<String>>,
    isolation: Option<Spanned<String>>,
    keep_capabilities: Option<Spanned<Vec<Spanned<String>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResource {
    name: Spanned<String>,
    driver: Spanned<String>,
    #[serde(rename = "match")]
    // Values are checked by hand so that one non-string glob does not hide the other globs' errors.
    matches: Option<BTreeMap<String, Spanned<toml::Value>>>,
    replicas: Option<Spanned<i64>>,
    one_replica_per_container: Option<bool>,
    device_list_strategy: Option<Spanned<DeviceListStrategy>>,
    api: Option<Spanned<String>>,
    dra_driver: Option<Spanned<String>>,
    dra_taint_effect: Option<Spanned<String>>,
}

impl Manifest {
    /// Reads and parses the manifest at `path`. `kubelet_dir_override` (from the command line)
    /// replaces the manifest's `kubelet_dir` before socket paths are checked.
    pub fn load(path: &Path, kubelet_dir_override: Option<&Path>) -> Result<Manifest, ManifestErrors> {
        let text = std::fs::read_to_string(path).map_err(|error| {
            ManifestErrors(vec![Diagnostic {
                location: path.display().to_string(),
                field: "manifest".to_owned(),
                message: format!("cannot read the manifest file: {error}"),
            }])
        })?;
        Self::parse(&text, path, kubelet_dir_override)
    }

    /// Parses manifest text; `path` names the file in diagnostics and anchors relative paths.
    pub fn parse(text: &str, path: &Path, kubelet_dir_override: Option<&Path>) -> Result<Manifest, ManifestErrors> {
        parse(text, path, kubelet_dir_override)
    }
}

fn parse(text: &str, path: &Path, kubelet_dir_override: Option<&Path>) -> Result<Manifest, ManifestErrors> {
    let mut diags = Diagnostics::new(path, text);
    let (document, syntax_errors) = DeTable::parse_recoverable(text);
    if !syntax_errors.is_empty() {
        return Err(syntax_only(diags, syntax_errors));
    }
    let document = Spanned::new(document.span(), DeValue::Table(document.into_inner()));
    let top: RawTop = deserialize_section(&document, "", &mut diags).unwrap_or_default();
    let base = path.parent().unwrap_or(Path::new(""));
    let kubelet_dir = match kubelet_dir_override {
        Some(dir) => dir.to_path_buf(),
        None => resolve_dir(&top.kubelet_dir, "kubelet_dir", DEFAULT_KUBELET_DIR, base, &mut diags),
    };
    let driver_dir = resolve_dir(&top.driver_dir, "driver_dir", DEFAULT_DRIVER_DIR, base, &mut diags);
    let kubelet_root_dir = resolve_dir(
        &top.kubelet_root_dir,
        "kubelet_root_dir",
        super::model::DEFAULT_KUBELET_ROOT_DIR,
        base,
        &mut diags,
    );
    let kubeconfig = top.kubeconfig.as_ref().map(|_| resolve_dir(&top.kubeconfig, "kubeconfig", "", base, &mut diags));
    let node_name = super::dra::node_name(&top.node_name, &mut diags);
    let default_timeout = top.call_timeout.map_or(DEFAULT_CALL_TIMEOUT, |t| t.0);
    let cdi_dir = features::cdi_dir(&top.cdi_dir, base, &mut diags);
    let cdi_spec_dirs = features::cdi_spec_dirs(&top.cdi_spec_dirs, base, &mut diags);
    let nfd_features_dir = features::nfd_features_dir(&top.nfd_features_dir, base, &mut diags);
    let metrics_addr = features::metrics_addr(&top.metrics_addr, &mut diags);
    let pod_resources_socket = pod_resources::socket(&top.pod_resources_socket, base, &mut diags);
    let pod_resources_interval = top.pod_resources_interval.map_or(DEFAULT_POD_RESOURCES_INTERVAL, |t| t.0);
    let runtime_socket = pod_resources::runtime_socket(&top.runtime_socket, base, &mut diags);
    let lock_dir = resolve_dir(&top.lock_dir, "lock_dir", DEFAULT_LOCK_DIR, base, &mut diags);
    let state_dir = resolve_dir(&top.state_dir, "state_dir", DEFAULT_STATE_DIR, base, &mut diags);

    let DeValue::Table(table) = document.get_ref() else {
        return Err(ManifestErrors(diags.into_sorted()));
    };
    let mut builder = Builder {
        diags,
        kubelet_dir,
        driver_dir,
        default_timeout,
        drivers: BTreeMap::new(),
        declared_at: BTreeMap::new(),
        option_locations: BTreeMap::new(),
        driver_hints: BTreeMap::new(),
        resources: Vec::new(),
        // Set even when the path itself is bad, so resources do not also report it missing.
        cdi_dir_set: top.cdi_dir.is_some(),
    };
    if let Some(drivers) = table.get("driver") {
        builder.drivers(drivers);
    }
    if let Some(resources) = table.get("resource") {
        builder.resources(resources);
    }
    let mut manifest = builder.finish(path)?;
    manifest.allow_untrusted_modules = top.allow_untrusted_modules.unwrap_or(false);
    manifest.cdi_dir = cdi_dir;
    manifest.cdi_spec_dirs = cdi_spec_dirs;
    manifest.nfd_features_dir = nfd_features_dir;
    manifest.metrics_addr = metrics_addr;
    manifest.pod_resources_socket = pod_resources_socket;
    manifest.pod_resources_interval = pod_resources_interval;
    manifest.runtime_socket = runtime_socket;
    manifest.lock_dir = lock_dir;
    manifest.state_dir = state_dir;
    manifest.kubelet_root_dir = kubelet_root_dir;
    manifest.kubeconfig = kubeconfig;
    manifest.node_name = node_name;
    manifest.dra_claim_check_interval = top.dra_claim_check_interval.map_or(DEFAULT_DRA_CLAIM_CHECK_INTERVAL, |t| t.0);
    warn_of_no_effect(&mut manifest);
    Ok(manifest)
}

/// The errors of a manifest with syntax errors. What follows a syntax error is guesswork, so only
/// the syntax is reported, and only the first error of each line: the parser's recovery tends to
/// trip again on the same line.
fn syntax_only(mut diags: Diagnostics<'_>, errors: Vec<toml::de::Error>) -> ManifestErrors {
    let mut errors: Vec<_> =
        errors.into_iter().map(|error| (error.span().unwrap_or(0..0), error.message().to_owned())).collect();
    errors.sort_by_key(|(span, _)| span.start);
    let mut last_line = None;
    for (span, message) in errors {
        let location = diags.location(span.start);
        let line = location.rsplit_once(':').map(|(line, _)| line.to_owned());
        if line != last_line {
            diags.error(span, "syntax", message);
            last_line = line;
        }
    }
    ManifestErrors(diags.into_sorted())
}

/// Warnings for resource keys that have no effect as set.
fn warn_of_no_effect(manifest: &mut Manifest) {
    for (index, r) in manifest.resources.iter().enumerate() {
        if r.one_replica_per_container && r.replicas == 1 {
            let field = format!("resource[{index}].one_replica_per_container");
            manifest.warnings.push(format!("{}: {field}: has no effect without replicas > 1", r.location));
        }
        if r.replicas > 1 && r.api.dra_driver().is_some() {
            let field = format!("resource[{index}].replicas");
            manifest.warnings.push(format!(
                "{}: {field}: has no effect with api = \"dra\": DRA publishes each physical device once (pods share \
                 a device by sharing one ResourceClaim)",
                r.location
            ));
        }
    }
}

/// A directory key: relative paths are taken from the manifest's folder, so a manifest and its
/// modules can be moved together.
fn resolve_dir(
    value: &Option<Spanned<String>>,
    field: &str,
    default: &str,
    base: &Path,
    diags: &mut Diagnostics<'_>,
) -> PathBuf {
    match value {
        None => PathBuf::from(default),
        Some(dir) if dir.get_ref().is_empty() => {
            diags.error(dir.span(), field, "the path is empty");
            PathBuf::from(default)
        }
        Some(dir) => base.join(dir.get_ref()),
    }
}

struct Builder<'a> {
    diags: Diagnostics<'a>,
    kubelet_dir: PathBuf,
    driver_dir: PathBuf,
    default_timeout: std::time::Duration,
    drivers: BTreeMap<String, DriverConfig>,
    /// Byte offset of each `[driver.X]` header, for the unused-driver warning.
    declared_at: BTreeMap<String, usize>,
    option_locations: BTreeMap<String, Vec<(String, String)>>,
    driver_hints: BTreeMap<String, super::model::DriverHint>,
    resources: Vec<ResourceConfig>,
    /// Whether the manifest sets `cdi_dir` (resources may then use the `cdi` strategy).
    cdi_dir_set: bool,
}

impl Builder<'_> {
    fn drivers(&mut self, drivers: &Spanned<DeValue<'_>>) {
        let DeValue::Table(table) = drivers.get_ref() else {
            let message = "expected a table of driver instances, written as [driver.NAME] tables";
            self.diags.error(drivers.span(), "driver", message);
            return;
        };
        for (name, value) in table.iter() {
            let name_text = name.get_ref().to_string();
            let section = format!("driver.{name_text}");
            if let Err(why) = check_driver_name(&name_text) {
                self.diags.error(name.span(), &section, why);
            }
            if !matches!(value.get_ref(), DeValue::Table(_)) {
                let message = format!("expected a table, written as [driver.{name_text}]");
                self.diags.error(value.span(), &section, message);
                continue;
            }
            let Some(raw) = deserialize_section::<RawDriver>(value, &section, &mut self.diags) else {
                continue;
            };
            let module_candidates = match &raw.module {
                Some(module) if module.get_ref().is_empty() => {
                    let field = format!("{section}.module");
                    self.diags.error(module.span(), &field, "the module path is empty");
                    Vec::new()
                }
                Some(module) => vec![self.driver_dir.join(module.get_ref())],
                None => self.conventional_modules(&name_text),
            };
            let options = match &raw.options {
                Some(options) => {
                    let (pairs, duplicates) = flatten_options(options.get_ref());
                    for key in duplicates {
                        let message = format!("option `{key}` is given twice once nested tables are joined with '.'");
                        self.diags.error(options.span(), &format!("{section}.options"), message);
                    }
                    pairs
                }
                None => Vec::new(),
            };
            let sha256 = raw.sha256.as_ref().and_then(|pin| {
                let hex = pin.get_ref().to_ascii_lowercase();
                if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Some(hex)
                } else {
                    self.diags.error(pin.span(), &format!("{section}.sha256"), "expected 64 hexadecimal digits");
                    None
                }
            });
            let isolation = self.isolation(&raw, &section);
            self.declared_at.insert(name_text.clone(), value.span().start);
            self.option_locations
                .insert(name_text.clone(), super::notes::option_locations(value.get_ref(), &self.diags));
            let config = DriverConfig {
                name: name_text.clone(),
                module_candidates,
                options,
                poll_interval: raw.poll_interval.map(|d| d.0),
                call_timeout: raw.call_timeout.map_or(self.default_timeout, |d| d.0),
                implicit: false,
                sha256,
                isolation,
            };
            self.drivers.insert(name_text, config);
        }
    }

    /// `isolation` and `keep_capabilities`: capability names are checked here so that a typo is
    /// an error at its line, not a worker that silently keeps nothing.
    fn isolation(&mut self, raw: &RawDriver, section: &str) -> Isolation {
        // Containment by default: in-process is an explicit opt-in.
        let process = match &raw.isolation {
            None => true,
            Some(mode) => match mode.get_ref().as_str() {
                "in-process" => false,
                "process" => true,
                other => {
                    let message = format!("unknown isolation {other:?}; expected \"in-process\" or \"process\"");
                    self.diags.error(mode.span(), &format!("{section}.isolation"), message);
                    false
                }
            },
        };
        let Some(caps) = &raw.keep_capabilities else {
            return if process { Isolation::Process { keep_capabilities: Vec::new() } } else { Isolation::InProcess };
        };
        let field = format!("{section}.keep_capabilities");
        if !process {
            let message = "only applies with isolation = \"process\" (an in-process driver has the host's privileges)";
            self.diags.error(caps.span(), &field, message);
            return Isolation::InProcess;
        }
        let mut keep = Vec::new();
        for cap in caps.get_ref() {
            let name = cap.get_ref();
            if capability_number(name).is_some() {
                if !keep.contains(name) {
                    keep.push(name.clone());
                }
                continue;
            }
            let upper = name.to_ascii_uppercase();
            let guess = if upper.starts_with("CAP_") { upper } else { format!("CAP_{upper}") };
            let message = match capability_number(&guess) {
                Some(_) => format!("unknown capability {name:?}; did you mean {guess:?}?"),
                None => format!("unknown capability {name:?}; names are as in capabilities(7), e.g. \"CAP_SYS_ADMIN\""),
            };
            self.diags.error(cap.span(), &field, message);
        }
        Isolation::Process { keep_capabilities: keep }
    }

    /// `libdevhost_X.so` first (the name our build produces; cargo spells `-` as `_`), then a
    /// plain `X.so`.
    fn conventional_modules(&self, driver: &str) -> Vec<PathBuf> {
        let mut names = vec![format!("libdevhost_{driver}.so")];
        if driver.contains('-') {
            names.push(format!("libdevhost_{}.so", driver.replace('-', "_")));
        }
        names.push(format!("{driver}.so"));
        names.into_iter().map(|n| self.driver_dir.join(n)).collect()
    }

    fn resources(&mut self, resources: &Spanned<DeValue<'_>>) {
        let DeValue::Array(items) = resources.get_ref() else {
            let message = "expected an array of tables, written as [[resource]] sections";
            self.diags.error(resources.span(), "resource", message);
            return;
        };
        for (index, item) in items.iter().enumerate() {
            let section = format!("resource[{index}]");
            if !matches!(item.get_ref(), DeValue::Table(_)) {
                self.diags.error(item.span(), &section, "expected a table");
                continue;
            }
            if let Some(raw) = deserialize_section::<RawResource>(item, &section, &mut self.diags) {
                self.resource(raw, item.span().start, &section);
            }
        }
    }

    fn resource(&mut self, raw: RawResource, offset: usize, section: &str) {
        let location = self.diags.location(offset);
        let name = raw.name.get_ref().clone();
        let name_field = format!("{section}.name");
        let name_ok = match check_resource_name(&name) {
            Ok(()) => true,
            Err(why) => {
                self.diags.error(raw.name.span(), &name_field, why);
                false
            }
        };
        if let Some(first) = self.resources.iter().find(|r| r.name == name) {
            let message = format!("resource `{name}` is already defined at {}", first.location);
            self.diags.error(raw.name.span(), &name_field, message);
        }
        let driver = raw.driver.get_ref().clone();
        self.resource_driver(&raw.driver, section);
        let replicas = features::replicas(raw.replicas.as_ref(), section, &mut self.diags);
        let strategy =
            features::strategy(raw.device_list_strategy.as_ref(), section, self.cdi_dir_set, &mut self.diags);
        if name_ok && self.cdi_dir_set {
            features::cdi_kind(&raw.name, section, &mut self.diags);
        }
        let api =
            super::dra::api(raw.api.as_ref(), raw.dra_driver.as_ref(), &raw.name, name_ok, section, &mut self.diags);
        if let Some(dra) = api.dra_driver()
            && let Some(first) = self.resources.iter().find(|r| r.api.dra_driver() == Some(dra))
        {
            let message = format!(
                "DRA driver name `{dra}` is already used by resource `{}` at {}; set `dra_driver` to tell them apart",
                first.name, first.location
            );
            let span = raw.dra_driver.as_ref().or(raw.api.as_ref()).map_or(raw.name.span(), Spanned::span);
            self.diags.error(span, &format!("{section}.dra_driver"), message);
        }
        let socket = socket_name(&name);
        let socket_len = self.kubelet_dir.join(&socket).as_os_str().len();
        // A DRA resource has no device-plugin socket (its own sockets are checked when served).
        if name_ok && api.dra_driver().is_none() && socket_len > MAX_SOCKET_PATH {
            let message = format!(
                "the socket path {} is {socket_len} bytes long; a unix socket path may have at \
                 most {MAX_SOCKET_PATH} bytes (shorten the resource name or kubelet_dir)",
                self.kubelet_dir.join(&socket).display()
            );
            self.diags.error(raw.name.span(), &name_field, message);
        }
        let matches = self.matches(raw.matches.unwrap_or_default(), section);
        self.resources.push(ResourceConfig {
            name,
            driver,
            matches,
            socket_name: socket,
            location,
            replicas,
            one_replica_per_container: raw.one_replica_per_container.unwrap_or(false),
            device_list_strategy: strategy,
            dra_taint_effect: super::dra::taint_effect(raw.dra_taint_effect.as_ref(), &api, section, &mut self.diags),
            api,
        });
    }

    /// Checks the driver a resource names; one no `[driver.X]` table declares is added as an
    /// implicit driver (with a hint when a declared name is close to it).
    fn resource_driver(&mut self, raw_driver: &Spanned<String>, section: &str) {
        let driver = raw_driver.get_ref().clone();
        match check_driver_name(&driver) {
            Err(why) => self.diags.error(raw_driver.span(), &format!("{section}.driver"), why),
            Ok(()) if !self.drivers.contains_key(&driver) => {
                // The module may appear later; whether it exists is the loader's question.
                let config = DriverConfig {
                    name: driver.clone(),
                    module_candidates: self.conventional_modules(&driver),
                    options: Vec::new(),
                    poll_interval: None,
                    call_timeout: self.default_timeout,
                    implicit: true,
                    sha256: None,
                    isolation: Isolation::default(),
                };
                self.drivers.insert(driver.clone(), config);
                let declared = self.declared_at.keys().map(String::as_str);
                if let Some((similar, &offset)) =
                    super::notes::similar(&driver, declared).and_then(|s| self.declared_at.get_key_value(s))
                {
                    let hint = super::model::DriverHint {
                        at: self.diags.location(raw_driver.span().start),
                        similar: similar.clone(),
                        similar_at: self.diags.location(offset),
                    };
                    self.driver_hints.insert(driver.clone(), hint);
                }
            }
            Ok(()) => {}
        }
    }

    /// A resource's `match` globs, each checked: a string, a named attribute, not empty.
    fn matches(&mut self, raw: BTreeMap<String, Spanned<toml::Value>>, section: &str) -> Vec<(String, String)> {
        let mut matches = Vec::new();
        for (key, pattern) in raw {
            let field = format!("{section}.match.{key}");
            let span = pattern.span();
            let toml::Value::String(pattern) = pattern.into_inner() else {
                self.diags.error(span, &field, "the glob must be a string");
                continue;
            };
            if key.is_empty() {
                self.diags.error(span, &field, "the attribute name is empty");
            } else if pattern.is_empty() {
                let message = "the glob is empty; use \"*\" to accept any value";
                self.diags.error(span, &field, message);
            }
            matches.push((key, pattern));
        }
        matches
    }

    fn finish(self, path: &Path) -> Result<Manifest, ManifestErrors> {
        if !self.diags.is_empty() {
            return Err(ManifestErrors(self.diags.into_sorted()));
        }
        let used: BTreeSet<&str> = self.resources.iter().map(|r| r.driver.as_str()).collect();
        let warnings = self
            .declared_at
            .iter()
            .filter(|(name, _)| !used.contains(name.as_str()))
            .map(|(name, offset)| {
                format!("{}: driver.{name}: declared but no [[resource]] uses it", self.diags.location(*offset))
            })
            .collect();
        Ok(Manifest {
            path: path.to_path_buf(),
            kubelet_dir: self.kubelet_dir,
            driver_dir: self.driver_dir,
            kubelet_root_dir: PathBuf::from(super::model::DEFAULT_KUBELET_ROOT_DIR),
            kubeconfig: None,
            node_name: None,
            dra_claim_check_interval: DEFAULT_DRA_CLAIM_CHECK_INTERVAL,
            drivers: self.drivers,
            resources: self.resources,
            warnings,
            allow_untrusted_modules: false,
            cdi_dir: None,
            cdi_spec_dirs: super::model::DEFAULT_CDI_SPEC_DIRS.iter().map(PathBuf::from).collect(),
            nfd_features_dir: None,
            metrics_addr: None,
            pod_resources_socket: PathBuf::from(super::model::DEFAULT_POD_RESOURCES_SOCKET),
            pod_resources_interval: DEFAULT_POD_RESOURCES_INTERVAL,
            runtime_socket: PathBuf::from(super::model::DEFAULT_RUNTIME_SOCKET),
            lock_dir: PathBuf::from(DEFAULT_LOCK_DIR),
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            option_locations: self.option_locations,
            driver_hints: self.driver_hints,
        })
    }
}
