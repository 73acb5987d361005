//! Metrics and probes on `metrics_addr`: `/metrics` in the Prometheus text format (OpenMetrics
//! when the scraper asks for it) through the Prometheus project's `prometheus-client`, `/healthz`
//! (the process and its async runtime answer), `/readyz` (every enabled resource is registered
//! with the kubelet) and `/status` (the JSON of [`crate::ops::status`]). The server is a small hyper 1
//! HTTP/1.1 loop; what each path answers is decided by [`respond`], which needs no socket.

use crate::driver::instance::CallError;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Upper bounds of the Allocate latency buckets, in seconds: from a composed answer (well under
/// a millisecond) to a driver hook near the default 10 s call deadline.
const ALLOCATE_BUCKETS: [f64; 13] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT_TYPE: &str = "text/plain; charset=utf-8";
const JSON_TYPE: &str = "application/json";
/// A client that has not sent its request headers by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

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
    call: String,
    outcome: String,
}

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
    allocations: Family<AllocationLabels, Counter>,
    allocate_duration: Family<ResourceLabels, Histogram>,
    registrations: Family<ResourceLabels, Counter>,
    registered: Family<ResourceLabels, Gauge>,
    kubelet_restarts: Counter,
    driver_calls: Family<CallLabels, Counter>,
    module_load_failures: Family<DriverLabels, Counter>,
    create_retrying: Family<DriverLabels, Gauge>,
    create_failed_attempts: Family<DriverLabels, Gauge>,
}

fn resource(name: &str) -> ResourceLabels {
    ResourceLabels { resource: name.to_string() }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("devhost");
        let devices = Family::<DeviceLabels, Gauge>::default();
        let unhealthy_devices = Family::<ResourceLabels, Gauge>::default();
        let allocations = Family::<AllocationLabels, Counter>::default();
        let allocate_duration = Family::<ResourceLabels, Histogram>::new_with_constructor(
            (|| Histogram::new(ALLOCATE_BUCKETS)) as fn() -> Histogram,
        );
        let registrations = Family::<ResourceLabels, Counter>::default();
        let registered = Family::<ResourceLabels, Gauge>::default();
        let kubelet_restarts = Counter::default();
        let driver_calls = Family::<CallLabels, Counter>::default();
        let module_load_failures = Family::<DriverLabels, Counter>::default();
        let create_retrying = Family::<DriverLabels, Gauge>::default();
        let create_failed_attempts = Family::<DriverLabels, Gauge>::default();
        // Counter names get their `_total` and histograms their unit from the encoder.
        registry.register("devices", "Devices advertised per resource and health", devices.clone());
        registry.register(
            "unhealthy_devices",
            "Physical devices of the resource that are Unhealthy now (replicas not counted; why: /status)",
            unhealthy_devices.clone(),
        );
        registry.register("allocations", "Allocate container requests per resource and outcome", allocations.clone());
        registry.register_with_unit(
            "allocate_duration",
            "Time to answer one Allocate call, per resource",
            Unit::Seconds,
            allocate_duration.clone(),
        );
        registry.register("registrations", "Successful registrations with the kubelet", registrations.clone());
        registry.register(
            "resource_registered",
            "1 while the resource is registered with the current kubelet",
            registered.clone(),
        );
        registry.register(
            "kubelet_restarts",
            "Kubelet restarts seen (its socket was recreated)",
            kubelet_restarts.clone(),
        );
        registry.register(
            "driver_calls",
            "Calls into driver modules per driver, call and outcome",
            driver_calls.clone(),
        );
        registry.register(
            "module_load_failures",
            "Driver modules that could not be loaded or instantiated",
            module_load_failures.clone(),
        );
        registry.register(
            "driver_create_retrying",
            "1 while the driver's create has failed and is retried with backoff",
            create_retrying.clone(),
        );
        registry.register(
            "driver_create_failed_attempts",
            "Failed create attempts of the driver since it last started (0 once create succeeded)",
            create_failed_attempts.clone(),
        );
        let mut build_labels = vec![("version".to_string(), env!("CARGO_PKG_VERSION").to_string())];
        // The git commit of the build (host/build.rs); none in a build without git.
        if !env!("DEVHOST_COMMIT").is_empty() {
            build_labels.push(("commit".to_string(), env!("DEVHOST_COMMIT").to_string()));
        }
        let build = Info::new(build_labels);
        registry.register("build", "The devhost build", build);
        Metrics {
            registry,
            devices,
            unhealthy_devices,
            allocations,
            allocate_duration,
            registrations,
            registered,
            kubelet_restarts,
            driver_calls,
            module_load_failures,
            create_retrying,
            create_failed_attempts,
        }
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
                let labels =
                    CallLabels { driver: driver.to_string(), call: call.to_string(), outcome: outcome.to_string() };
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
        for call in ["scan", "allocate", "preferred_allocation", "pre_start"] {
            for outcome in CALL_OUTCOMES {
                let labels =
                    CallLabels { driver: driver.to_string(), call: call.to_string(), outcome: outcome.to_string() };
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
    pub fn driver_call(&self, driver: &str, call: &str, outcome: &str) {
        let labels = CallLabels { driver: driver.to_string(), call: call.to_string(), outcome: outcome.to_string() };
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
        self.allocate_duration.remove(&resource(name));
        self.registrations.remove(&resource(name));
        self.registered.remove(&resource(name));
    }

    /// The exposition text: OpenMetrics 1.0 or the Prometheus text format 0.0.4.
    pub fn encode(&self, openmetrics: bool) -> Result<String, std::fmt::Error> {
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

pub type Check<T> = Arc<dyn Fn() -> T + Send + Sync>;

/// What the probes ask the rest of the host. The closures run on the async runtime, so they
/// must be quick and never block (take a lock, read a flag).
#[derive(Clone)]
pub struct Probes {
    /// `/healthz`: `Err(why)` when the host is alive but broken. The handler running at all
    /// already proves the runtime answers.
    pub live: Check<Result<(), String>>,
    /// `/readyz`: `Err(resources not registered)` until every enabled resource is registered.
    pub ready: Check<Result<(), Vec<String>>>,
    /// `/status`: the document of [`crate::ops::status::status_json`].
    pub status: Check<serde_json::Value>,
}

impl Probes {
    /// Probes with an always-passing liveness check.
    pub fn new(
        ready: impl Fn() -> Result<(), Vec<String>> + Send + Sync + 'static,
        status: impl Fn() -> serde_json::Value + Send + Sync + 'static,
    ) -> Probes {
        Probes { live: Arc::new(|| Ok(())), ready: Arc::new(ready), status: Arc::new(status) }
    }
}

/// An HTTP answer before it meets the wire.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

fn answer(status: u16, content_type: &'static str, body: impl Into<String>) -> Answer {
    Answer { status, content_type, body: body.into() }
}

/// What a `GET` (or `HEAD`) of `path` answers. `accept` is the request's Accept header: a
/// scraper that names `application/openmetrics-text` gets OpenMetrics.
pub fn respond(path: &str, accept: Option<&str>, metrics: &Metrics, probes: &Probes) -> Answer {
    match path {
        "/metrics" => {
            let openmetrics = accept.is_some_and(|a| a.contains("application/openmetrics-text"));
            let content_type =
                if openmetrics { OPENMETRICS_TYPE } else { prometheus_client::encoding::prometheus_text::CONTENT_TYPE };
            match metrics.encode(openmetrics) {
                Ok(text) => answer(200, content_type, text),
                Err(e) => answer(500, TEXT_TYPE, format!("cannot encode metrics: {e}\n")),
            }
        }
        "/healthz" => match (probes.live)() {
            Ok(()) => answer(200, TEXT_TYPE, "ok\n"),
            Err(why) => answer(503, TEXT_TYPE, format!("unhealthy: {why}\n")),
        },
        "/readyz" => match (probes.ready)() {
            Ok(()) => answer(200, TEXT_TYPE, "ready\n"),
            Err(missing) => {
                answer(503, TEXT_TYPE, format!("not ready: not registered with the kubelet: {}\n", missing.join(", ")))
            }
        },
        "/status" => match serde_json::to_string_pretty(&(probes.status)()) {
            Ok(mut text) => {
                text.push('\n');
                answer(200, JSON_TYPE, text)
            }
            Err(e) => answer(500, TEXT_TYPE, format!("cannot encode the status: {e}\n")),
        },
        "/" => answer(200, TEXT_TYPE, "devhost: /metrics /healthz /readyz /status\n"),
        _ => answer(404, TEXT_TYPE, format!("no such path {path:?}; try /metrics /healthz /readyz /status\n")),
    }
}

fn to_response(req: &Request<Incoming>, metrics: &Metrics, probes: &Probes) -> Response<Full<Bytes>> {
    let a = if req.method() == Method::GET || req.method() == Method::HEAD {
        let accept = req.headers().get(header::ACCEPT).and_then(|v| v.to_str().ok());
        respond(req.uri().path(), accept, metrics, probes)
    } else {
        answer(405, TEXT_TYPE, "only GET and HEAD are served\n")
    };
    let mut resp = Response::new(Full::new(Bytes::from(a.body)));
    *resp.status_mut() = StatusCode::from_u16(a.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(a.content_type));
    if a.status == 405 {
        resp.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
    }
    resp
}

/// Binds the metrics address; a separate step so that a taken port fails the start, naming it.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("metrics_addr {addr}: cannot listen: {e}")))
}

/// Serves the four paths until `stop` turns true (or its sender goes away); then open
/// connections are closed.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, probes: Probes, mut stop: watch::Receiver<bool>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (metrics, probes) = (metrics.clone(), probes.clone());
                    conns.spawn(async move {
                        let svc = hyper::service::service_fn(move |req| {
                            let resp = to_response(&req, &metrics, &probes);
                            async move { Ok::<_, std::convert::Infallible>(resp) }
                        });
                        let conn = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(HEADER_TIMEOUT)
                            .serve_connection(TokioIo::new(stream), svc);
                        if let Err(e) = conn.await {
                            tracing::debug!("metrics connection ended: {e}");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("metrics endpoint cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            // The guard `wait_for` returns must not live across the select's other awaits.
            () = async { drop(stop.wait_for(|s| *s).await) } => break,
        }
    }
    conns.abort_all();
}

/// Where to reach a server bound to `bind`: an unspecified address (`0.0.0.0`, `::`) becomes
/// the loopback of its family.
pub fn connect_addr(bind: SocketAddr) -> SocketAddr {
    match bind.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bind.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), bind.port()),
        _ => bind,
    }
}

/// A plain HTTP/1.1 reply.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

/// A minimal HTTP/1.1 GET with `Connection: close` (used by the tests to scrape the daemon).
/// Gives up after 5 s.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> std::io::Result<Reply> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        for (k, v) in headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        request.push_str("\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        parse_reply(&String::from_utf8_lossy(&raw))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange).await.map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::TimedOut, format!("GET http://{addr}{path}: no answer in 5 s"))
    })?
}

fn parse_reply(raw: &str) -> std::io::Result<Reply> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed HTTP reply");
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = head.split("\r\n");
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Reply { status, headers, body: body.to_string() })
}

#[cfg(test)]
mod tests;
