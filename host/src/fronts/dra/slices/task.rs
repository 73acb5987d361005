//! The publisher's background task: a pass at every change of the resource's view, at every
//! change a watch on the slices sees, and every [`RESYNC`]; failures retried with the outage's
//! backoff and logged once (`outage`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

use super::super::api::ApiServer;
use super::super::outage::{Outage, Scope, log_failure, log_recovery};
use super::publisher::{Published, Publisher};
use crate::engine::registry::Resource;
use crate::engine::telemetry::Metrics;

/// How often the slices are compared with the API server's even when nothing was seen.
pub const RESYNC: Duration = Duration::from_secs(60);
/// The longest one publishing pass may take: the API client has no read timeout of its own, so
/// a server that accepted the connection and went silent (a network partition, a stopped
/// process) would hold the publisher, and every later change, until the connection broke.
pub const PASS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a watch may stay silent before it is started again (the server ends a watch with no
/// events after about 290 s, so only a dead connection stays silent longer).
const WATCH_SILENT: Duration = Duration::from_secs(300);
/// A watch that ends sooner than this counts as a failure, so a server that ends every watch at
/// once is not asked again in a loop.
const WATCH_SHORTEST: Duration = Duration::from_secs(5);
/// What the publisher's and the watch's log lines call their calls.
const PUBLISH: &str = "publish the ResourceSlices";
const WATCH: &str = "watch the ResourceSlices";

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts the publisher of `resource` as DRA driver `driver`; it ends when `stop` turns true
/// (leaving the slices in place, see the module docs).
pub fn spawn(
    driver: &str,
    resource: Arc<Resource>,
    api: ApiServer,
    metrics: Arc<Metrics>,
    stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let publisher = Publisher::new(driver, &resource.config.name, resource.config.dra_taint_effect, &api);
    tokio::spawn(run(publisher, resource, metrics, stop))
}

/// The task: a pass whenever the view changes, the watch pokes, or [`RESYNC`] passes; after a
/// failed pass, the next one waits for the outage's backoff.
async fn run(
    mut publisher: Publisher,
    resource: Arc<Resource>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let poke = Arc::new(Notify::new());
    let _watcher = AbortOnDrop(tokio::spawn(watch_slices(
        publisher.slices.clone(),
        publisher.selector.clone(),
        publisher.driver.clone(),
        publisher.node.clone(),
        poke.clone(),
    )));
    // Not before the resource's first device list is in (its driver's first scan, or the
    // start grace): publishing the empty list seen until then would tell the scheduler
    // this node has no devices of the driver for a moment at every start.
    tokio::select! {
        _ = stop.wait_for(|s| *s) => return,
        () = resource.first_scan() => {}
    }
    let mut view = resource.view.subscribe();
    let mut view_open = true;
    let mut outage = Outage::default();
    loop {
        let devices = view.borrow_and_update().devices.clone();
        let started = Instant::now();
        let result = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            r = tokio::time::timeout(PASS_TIMEOUT, publisher.reconcile(&devices)) => r.unwrap_or_else(|_| {
                Err(format!("no answer from the API server within {} s", PASS_TIMEOUT.as_secs()))
            }),
        };
        if let Err(wait) = report(&publisher, &metrics, &mut outage, result, started) {
            // Device changes meanwhile wait for the next attempt: the pass reads the newest
            // view, so no update is lost, and a flapping device cannot make the attempts
            // against a server that is away more frequent.
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                _ = tokio::time::sleep(wait) => continue,
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            changed = view.changed(), if view_open => view_open = changed.is_ok(),
            _ = poke.notified() => {}
            _ = tokio::time::sleep(RESYNC) => {}
        }
    }
}

/// Counts and logs one pass (begun at `started`); after a failure, how long to wait.
fn report(
    publisher: &Publisher,
    metrics: &Metrics,
    outage: &mut Outage,
    result: Result<Option<Published>, String>,
    started: Instant,
) -> Result<(), Duration> {
    let scope = Scope { driver: &publisher.driver, node: &publisher.node };
    match result {
        Ok(done) => {
            if let Some((attempts, lasted)) = outage.succeeded(Instant::now()) {
                log_recovery(scope, PUBLISH, attempts, lasted);
            }
            if let Some(p) = done {
                metrics.dra_slices_published(&publisher.resource, Some(p.devices));
                tracing::info!(
                    resource = %publisher.resource,
                    dra_driver = %publisher.driver,
                    node = %publisher.node,
                    devices = p.devices,
                    slices = p.slices,
                    generation = p.generation,
                    ms = started.elapsed().as_millis() as u64,
                    "DRA: ResourceSlices published"
                );
            }
            Ok(())
        }
        Err(e) => {
            metrics.dra_slices_published(&publisher.resource, None);
            let verdict = outage.failed(Instant::now());
            log_failure(scope, &verdict, PUBLISH, &e);
            Err(verdict.wait())
        }
    }
}

/// Watches (driver, node)'s slices and pokes the publisher on every change someone made (our
/// own writes too; that pass then finds nothing to do), and when a watch ends (events may be
/// missed until the next one starts). A watch that cannot start, ends within
/// [`WATCH_SHORTEST`] or stays silent for [`WATCH_SILENT`] is started again after a backoff.
async fn watch_slices(slices: Api<ResourceSlice>, selector: String, driver: String, node: String, poke: Arc<Notify>) {
    let mut outage = Outage::default();
    let scope = Scope { driver: &driver, node: &node };
    loop {
        let began = Instant::now();
        let started = async {
            let list = slices.list(&ListParams::default().fields(&selector).limit(1)).await?;
            let version = list.metadata.resource_version.unwrap_or_default();
            slices.watch(&WatchParams::default().fields(&selector), &version).await
        };
        let ended = match tokio::time::timeout(PASS_TIMEOUT, started).await {
            Ok(Ok(stream)) => {
                let mut stream = std::pin::pin!(stream);
                let why = loop {
                    match tokio::time::timeout(WATCH_SILENT, stream.next()).await {
                        Ok(Some(Ok(WatchEvent::Added(_) | WatchEvent::Modified(_) | WatchEvent::Deleted(_)))) => {
                            poke.notify_one()
                        }
                        Ok(Some(Ok(WatchEvent::Bookmark(_)))) => {}
                        // 410 Gone (the version is too old) and the like: start over.
                        Ok(Some(Ok(WatchEvent::Error(e)))) => break format!("the watch ended: {}", e.message),
                        Ok(Some(Err(e))) => break format!("the watch broke: {e}"),
                        Ok(None) => break "the server ended the watch".to_owned(),
                        Err(_) => break format!("the watch was silent for {} s", WATCH_SILENT.as_secs()),
                    }
                };
                poke.notify_one();
                if began.elapsed() >= WATCH_SHORTEST {
                    if let Some((attempts, lasted)) = outage.succeeded(Instant::now()) {
                        log_recovery(scope, WATCH, attempts, lasted);
                    }
                    continue;
                }
                format!("{why} within {} ms of starting", began.elapsed().as_millis())
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer from the API server within {} s", PASS_TIMEOUT.as_secs()),
        };
        let verdict = outage.failed(Instant::now());
        log_failure(scope, &verdict, WATCH, &ended);
        tokio::time::sleep(verdict.wait()).await;
    }
}
