//! The metrics the host records as it runs: module loads, driver calls, devices per resource,
//! Allocate latencies, registrations. [`Metrics`] holds them in a `prometheus-client` registry;
//! serving them over HTTP is [`crate::ops::metrics`]'s job.

use crate::driver::instance::CallError;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Metric;
use prometheus_client::registry::{Registry, Unit};
use std::time::Duration;

/// Upper bounds of the Allocate latency buckets, in seconds: from a composed answer (well under
/// a millisecond) to a driver hook near the default 10 s call deadline.
const ALLOCATE_BUCKETS: [f64; 13] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    resource: String,
    health: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AllocationLabels {
    resource: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    driver: String,
    call: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimCallLabels {
    resource: String,
    call: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StaleLabels {
    resource: String,
    what: &'static str,
    outcome: &'static str,
}

/// Every (what, outcome) of `dra_stale_claims`, created at 0 with the resource.
const STALE_SERIES: [(&str, &str); 4] =
    [("claim", "ok"), ("claim", "error"), ("cdi_spec", "ok"), ("cdi_spec", "error")];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DriverLabels {
    driver: String,
}

/// Every metric the host exports, all under the `devhost_` prefix (names and types are listed in
/// docs/features.md). Updating one is an atomic add behind a short read lock: cheap enough for
/// the Allocate path.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    devices: Family<DeviceLabels, Gauge>,
    unhealthy_devices: Family<ResourceLabels, Gauge>,
    cdi_unresolvable_devices: Family<ResourceLabels, Gauge>,
    allocations: Family<AllocationLabels, Counter>,
    allocate_duration: Family<ResourceLabels, Histogram>,
    registrations: Family<ResourceLabels, Counter>,
    registered: Family<ResourceLabels, Gauge>,
    kubelet_restarts: Counter,
    driver_calls: Family<CallLabels, Counter>,
    module_load_failures: Family<DriverLabels, Counter>,
    create_retrying: Family<DriverLabels, Gauge>,
    create_failed_attempts: Family<DriverLabels, Gauge>,
    dra_slice_publishes: Family<AllocationLabels, Counter>,
    dra_published_devices: Family<ResourceLabels, Gauge>,
    dra_claim_calls: Family<ClaimCallLabels, Counter>,
    dra_prepared_claims: Family<ResourceLabels, Gauge>,
    dra_stale_claims: Family<StaleLabels, Counter>,
    runtime_tasks: Gauge,
}

fn resource(name: &str) -> ResourceLabels {
    ResourceLabels { resource: name.to_string() }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// A metric of type `M`, created empty and registered under `name` with `help`.
fn registered<M: Metric + Clone + Default>(registry: &mut Registry, name: &str, help: &str) -> M {
    let metric = M::default();
    registry.register(name, help, metric.clone());
    metric
}

/// The Allocate latency histograms, per resource, in seconds.
fn allocate_duration(registry: &mut Registry) -> Family<ResourceLabels, Histogram> {
    let family = Family::<ResourceLabels, Histogram>::new_with_constructor(
        (|| Histogram::new(ALLOCATE_BUCKETS)) as fn() -> Histogram,
    );
    registry.register_with_unit(
        "allocate_duration",
        "Time to answer one Allocate call, per resource",
        Unit::Seconds,
        family.clone(),
    );
    family
}

/// The build's version and git commit (host/build.rs; none in a build without git), as the
/// `devhost_build_info` metric.
fn register_build_info(registry: &mut Registry) {
    let mut labels = vec![("version".to_string(), env!("CARGO_PKG_VERSION").to_string())];
    if !env!("DEVHOST_COMMIT").is_empty() {
        labels.push(("commit".to_string(), env!("DEVHOST_COMMIT").to_string()));
    }
    registry.register("build", "The devhost build", Info::new(labels));
}

impl Metrics {
    /// Every metric, registered in the order a scrape lists them. Counter names get their
    /// `_total` and histograms their unit from the encoder.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("devhost");
        let r = &mut registry;
        Metrics {
            runtime_tasks: registered(
                r,
                "runtime_tasks",
                "Async tasks alive in the daemon's runtime, read at each scrape (flat over time on a node at rest)",
            ),
            devices: registered(r, "devices", "Devices advertised per resource and health"),
            unhealthy_devices: registered(
                r,
                "unhealthy_devices",
                "Physical devices of the resource that are Unhealthy now (replicas not counted; why: /status)",
            ),
            cdi_unresolvable_devices: registered(
                r,
                "cdi_unresolvable_devices",
                "Devices of the resource with a CDI name the runtime's CDI folders do not resolve (missing or defined twice; why: the log)",
            ),
            allocations: registered(r, "allocations", "Allocate container requests per resource and outcome"),
            allocate_duration: allocate_duration(r),
            registrations: registered(r, "registrations", "Successful registrations with the kubelet"),
            registered: registered(
                r,
                "resource_registered",
                "1 while the resource is registered with the current kubelet",
            ),
            kubelet_restarts: registered(r, "kubelet_restarts", "Kubelet restarts seen (its socket was recreated)"),
            driver_calls: registered(r, "driver_calls", "Calls into driver modules per driver, call and outcome"),
            module_load_failures: registered(
                r,
                "module_load_failures",
                "Driver modules that could not be loaded or instantiated",
            ),
            create_retrying: registered(
                r,
                "driver_create_retrying",
                "1 while the driver's create has failed and is retried with backoff",
            ),
            create_failed_attempts: registered(
                r,
                "driver_create_failed_attempts",
                "Failed create attempts of the driver since it last started (0 once create succeeded)",
            ),
            dra_slice_publishes: registered(
                r,
                "dra_slice_publishes",
                "Passes that wrote a DRA resource's ResourceSlices to the API server, per outcome",
            ),
            dra_published_devices: registered(
                r,
                "dra_published_devices",
                "Devices of the DRA resource in its ResourceSlices as last published",
            ),
            dra_claim_calls: registered(
                r,
                "dra_claim_calls",
                "Claims the kubelet asked a DRA resource to prepare or unprepare, per call and outcome",
            ),
            dra_prepared_claims: registered(
                r,
                "dra_prepared_claims",
                "Claims a DRA resource holds prepared (its checkpoint)",
            ),
            dra_stale_claims: registered(
                r,
                "dra_stale_claims",
                "Stale claims (gone from the API server, used by no container) a DRA resource unprepared by itself, \
                 and stale CDI specs it removed, per what and outcome",
            ),
            registry: {
                register_build_info(r);
                registry
            },
        }
    }

    /// Creates, at 0, every DRA series of a resource served through DRA (when its front starts).
    pub fn dra_resource_configured(&self, name: &str) {
        for outcome in ["ok", "error"] {
            drop(self.dra_slice_publishes.get_or_create(&AllocationLabels { resource: name.to_string(), outcome }));
            for call in ["prepare", "unprepare"] {
                drop(self.dra_claim_calls.get_or_create(&ClaimCallLabels {
                    resource: name.to_string(),
                    call,
                    outcome,
                }));
            }
        }
        drop(self.dra_published_devices.get_or_create(&resource(name)));
        drop(self.dra_prepared_claims.get_or_create(&resource(name)));
        for (what, outcome) in STALE_SERIES {
            drop(self.dra_stale_claims.get_or_create(&StaleLabels { resource: name.to_string(), what, outcome }));
        }
    }

    /// The claims a DRA resource holds prepared now.
    pub fn dra_prepared(&self, name: &str, prepared: usize) {
        self.dra_prepared_claims.get_or_create(&resource(name)).set(prepared as i64);
    }

    /// One stale claim unprepared (`what` = "claim") or stale CDI spec removed ("cdi_spec").
    pub fn dra_stale_cleanup(&self, name: &str, what: &'static str, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.dra_stale_claims.get_or_create(&StaleLabels { resource: name.to_string(), what, outcome }).inc();
    }

    /// A publishing pass of a DRA resource's slices: `Some(devices)` published, `None` failed.
    pub fn dra_slices_published(&self, name: &str, devices: Option<usize>) {
        let outcome = if devices.is_some() { "ok" } else { "error" };
        self.dra_slice_publishes.get_or_create(&AllocationLabels { resource: name.to_string(), outcome }).inc();
        if let Some(n) = devices {
            self.dra_published_devices.get_or_create(&resource(name)).set(n as i64);
        }
    }

    /// One claim's Prepare or Unprepare (`call`), and the claims now held prepared.
    pub fn dra_claim_call(&self, name: &str, call: &'static str, ok: bool, prepared: usize) {
        let outcome = if ok { "ok" } else { "error" };
        self.dra_claim_calls.get_or_create(&ClaimCallLabels { resource: name.to_string(), call, outcome }).inc();
        self.dra_prepared_claims.get_or_create(&resource(name)).set(prepared as i64);
    }

    /// Sets a driver's create-retry series (both exist, at 0, from the
    /// driver's first load on).
    pub fn set_create_retry(&self, driver: &str, retry: Option<&crate::driver::instance::CreateRetry>) {
        let labels = DriverLabels { driver: driver.to_string() };
        self.create_retrying.get_or_create(&labels).set(i64::from(retry.is_some()));
        self.create_failed_attempts.get_or_create(&labels).set(retry.map_or(0, |r| i64::from(r.attempts)));
    }

    /// Creates, at 0, every series a configured driver may ever have (its load failures and, for
    /// each call it can receive, every outcome), so that `increase()` and `== 0` alerts see the
    /// first change instead of a series that appears already changed. Values already counted
    /// stay.
    pub fn driver_configured(&self, driver: &str, module: Option<&crate::driver::loader::ModuleInfo>) {
        drop(self.module_load_failures.get_or_create(&DriverLabels { driver: driver.to_string() }));
        let Some(m) = module else { return };
        for (call, offered) in [
            ("scan", true),
            ("allocate", m.allocate),
            ("preferred_allocation", m.preferred_allocation),
            ("pre_start", m.pre_start),
        ] {
            for outcome in CALL_OUTCOMES.iter().filter(|_| offered) {
                let labels = CallLabels { driver: driver.to_string(), call, outcome };
                drop(self.driver_calls.get_or_create(&labels));
            }
        }
    }

    /// Creates, at 0, every series of a configured resource (devices, allocations, Allocate
    /// latency, registrations, `resource_registered`), whether or not its driver loaded. Values
    /// already set stay.
    pub fn resource_configured(&self, name: &str) {
        for health in ["healthy", "unhealthy"] {
            drop(self.devices.get_or_create(&DeviceLabels { resource: name.to_string(), health }));
        }
        for outcome in ["ok", "error"] {
            drop(self.allocations.get_or_create(&AllocationLabels { resource: name.to_string(), outcome }));
        }
        drop(self.allocate_duration.get_or_create(&resource(name)));
        drop(self.registrations.get_or_create(&resource(name)));
        drop(self.registered.get_or_create(&resource(name)));
        drop(self.unhealthy_devices.get_or_create(&resource(name)));
    }

    /// Drops a driver's series (it left the manifest).
    pub fn forget_driver(&self, driver: &str) {
        let labels = DriverLabels { driver: driver.to_string() };
        self.create_retrying.remove(&labels);
        self.create_failed_attempts.remove(&labels);
        self.module_load_failures.remove(&labels);
        for call in ["scan", "allocate", "preferred_allocation", "pre_start", "release"] {
            for outcome in CALL_OUTCOMES {
                let labels = CallLabels { driver: driver.to_string(), call, outcome };
                self.driver_calls.remove(&labels);
            }
        }
    }

    /// Sets a resource's advertised device counts (replicas count as devices).
    pub fn set_devices(&self, resource: &str, healthy: usize, unhealthy: usize) {
        for (health, n) in [("healthy", healthy), ("unhealthy", unhealthy)] {
            let labels = DeviceLabels { resource: resource.to_string(), health };
            self.devices.get_or_create(&labels).set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Sets how many physical devices of a resource are Unhealthy.
    pub fn set_unhealthy_devices(&self, resource: &str, unhealthy: usize) {
        self.unhealthy_devices
            .get_or_create(&self::resource(resource))
            .set(i64::try_from(unhealthy).unwrap_or(i64::MAX));
    }

    /// How many of the resource's devices have a CDI name that does not resolve.
    pub fn set_cdi_unresolvable(&self, resource: &str, devices: usize) {
        self.cdi_unresolvable_devices
            .get_or_create(&self::resource(resource))
            .set(i64::try_from(devices).unwrap_or(i64::MAX));
    }

    /// Counts one Allocate container request and, per call, its latency.
    pub fn allocation(&self, resource: &str, ok: bool, latency: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.allocations.get_or_create(&AllocationLabels { resource: resource.to_string(), outcome }).inc();
        self.allocate_duration.get_or_create(&self::resource(resource)).observe(latency.as_secs_f64());
    }

    /// A successful registration with the kubelet.
    pub fn registered(&self, resource: &str) {
        self.registrations.get_or_create(&self::resource(resource)).inc();
        self.registered.get_or_create(&self::resource(resource)).set(1);
    }

    /// The resource is no longer registered (kubelet gone, endpoint retired).
    pub fn unregistered(&self, resource: &str) {
        self.registered.get_or_create(&self::resource(resource)).set(0);
    }

    pub fn kubelet_restart(&self) {
        self.kubelet_restarts.inc();
    }

    /// One call into a driver; `outcome` is one of `ok`, `error`, `timeout`, `panic`, `refused`
    /// (see [`call_outcome`]).
    pub fn driver_call(&self, driver: &str, call: &'static str, outcome: &'static str) {
        let labels = CallLabels { driver: driver.to_string(), call, outcome };
        self.driver_calls.get_or_create(&labels).inc();
    }

    pub fn module_load_failure(&self, driver: &str) {
        self.module_load_failures.get_or_create(&DriverLabels { driver: driver.to_string() }).inc();
    }

    /// Drops a resource's series when a reload stops it, so dashboards do not show a ghost.
    pub fn forget_resource(&self, name: &str) {
        for health in ["healthy", "unhealthy"] {
            self.devices.remove(&DeviceLabels { resource: name.to_string(), health });
        }
        for outcome in ["ok", "error"] {
            self.allocations.remove(&AllocationLabels { resource: name.to_string(), outcome });
        }
        self.unhealthy_devices.remove(&resource(name));
        self.cdi_unresolvable_devices.remove(&resource(name));
        self.allocate_duration.remove(&resource(name));
        self.registrations.remove(&resource(name));
        self.registered.remove(&resource(name));
        for outcome in ["ok", "error"] {
            self.dra_slice_publishes.remove(&AllocationLabels { resource: name.to_string(), outcome });
            for call in ["prepare", "unprepare"] {
                self.dra_claim_calls.remove(&ClaimCallLabels { resource: name.to_string(), call, outcome });
            }
        }
        self.dra_published_devices.remove(&resource(name));
        self.dra_prepared_claims.remove(&resource(name));
        for (what, outcome) in STALE_SERIES {
            self.dra_stale_claims.remove(&StaleLabels { resource: name.to_string(), what, outcome });
        }
    }

    /// The exposition text: OpenMetrics 1.0 or the Prometheus text format 0.0.4.
    pub fn encode(&self, openmetrics: bool) -> Result<String, std::fmt::Error> {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            self.runtime_tasks.set(runtime.metrics().num_alive_tasks() as i64);
        }
        let mut out = String::new();
        if openmetrics {
            prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        } else {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)?;
        }
        Ok(out)
    }
}

/// Every value of a driver call's `outcome` label.
pub const CALL_OUTCOMES: [&str; 5] = ["ok", "error", "timeout", "panic", "refused"];

/// The `outcome` label of a driver call's result.
pub fn call_outcome<T>(result: &Result<T, CallError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(CallError::Timeout { .. }) => "timeout",
        Err(CallError::Status { code, .. }) if *code == devhost_abi::DEVHOST_ERR_PANIC => "panic",
        Err(CallError::Hung { .. } | CallError::Poisoned { .. } | CallError::Unavailable { .. }) => "refused",
        Err(_) => "error",
    }
}
