//! Preparing and unpreparing claims for one DRA driver: the work behind the plugin service.
//!
//! Prepare reads each claim from the API server first (no lock held), then, one call of the
//! driver at a time: a claim already in the [`Checkpoint`] is answered as before (its CDI spec
//! written again if it is gone: CDI folders are often tmpfs); a new one is mapped back to the
//! driver's devices ([`prepare::plan`]), checked against the devices other claims hold, composed
//! with the shared core's [`compose`] (one allocate hook call per claim), written as a CDI spec
//! ([`claim_spec`]) and kept in the checkpoint. Unprepare runs the driver's release hook (ABI
//! 1.1, the call the release module makes) for a known claim's devices, removes its spec and
//! forgets it; an unknown claim is already unprepared.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::sync::Mutex;

use super::api::ApiServer;
use super::checkpoint::{self, Checkpoint, PreparedClaim, PreparedDevice};
use super::claim_spec;
use super::parameters;
use super::prepare::{self, AllocationResult};
use super::taint::Toleration;
use crate::engine::registry::{Resource, View, compose};
use crate::engine::release::hook::{self as release_hook, Outcome, Releaser};
use crate::engine::telemetry::Metrics;

/// How long a claim GET may take (they run at once), well within the kubelet's 45 s deadline.
pub(super) const GET_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a DRA front keeps what it prepares.
#[derive(Clone)]
pub struct Settings {
    /// The folder the claims' CDI specs are written to.
    pub cdi_dir: PathBuf,
    /// The folder of the checkpoint (`dra-<driver>.json`).
    pub state_dir: PathBuf,
    pub metrics: Arc<Metrics>,
    /// The kubelet's PodResources socket, asked which claims its containers use before a
    /// stale claim is unprepared ([`super::stale`]).
    pub pod_resources_socket: PathBuf,
    /// How often prepared claims are checked for staleness, besides once at the start.
    pub claim_check_interval: Duration,
}

/// A claim the kubelet names: namespace, UID, name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

impl ClaimRef {
    pub(super) fn shown(&self) -> String {
        format!("{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// The devices of one prepared claim, or why it was not prepared.
pub type Prepared = Result<Vec<PreparedDevice>, String>;

/// The claims of one DRA driver.
pub struct Claims {
    driver: String,
    resource: Arc<Resource>,
    api: ApiServer,
    cdi_dir: PathBuf,
    metrics: Arc<Metrics>,
    /// Held for the whole of each Prepare and Unprepare: calls are serialised per driver.
    checkpoint: Mutex<Checkpoint>,
}

impl Claims {
    /// The claims of `driver` (serving `resource`), going on from its checkpoint in `settings`.
    pub fn new(driver: &str, resource: Arc<Resource>, api: ApiServer, settings: &Settings) -> Claims {
        Claims {
            driver: driver.to_owned(),
            resource,
            api,
            cdi_dir: settings.cdi_dir.clone(),
            metrics: settings.metrics.clone(),
            checkpoint: Mutex::new(Checkpoint::load(&settings.state_dir, driver)),
        }
    }

    /// Prepares `claims`: one answer per claim, or an error for the whole call when a claim
    /// cannot be read from the API server (the kubelet then retries the call). A claim this
    /// driver prepared before is answered from the checkpoint without asking the API server, so
    /// a kubelet that repeats Prepare (after its own restart, say) is answered while the API
    /// server is away; only claims new to the driver are read.
    pub async fn prepare(&self, claims: Vec<ClaimRef>) -> Result<Vec<(String, Prepared)>, String> {
        let unknown: Vec<usize> = {
            let checkpoint = self.checkpoint.lock().await;
            (0..claims.len()).filter(|&i| !checkpoint.claims.contains_key(&claims[i].uid)).collect()
        };
        // All GETs at once: the kubelet gives the whole call 45 s.
        let mut gets = tokio::task::JoinSet::new();
        for i in unknown {
            let (client, driver, claim) = (self.api.client.clone(), self.driver.clone(), claims[i].clone());
            gets.spawn(async move { (i, get(client, &driver, &claim).await) });
        }
        // A claim prepared before needs no allocation: `prepare_one` answers it from the checkpoint
        // (or, if an Unprepare dropped it meanwhile, refuses it; the kubelet's retry reads it).
        let mut got: Vec<Read> = vec![Ok(Err(NOT_READ.to_owned())); claims.len()];
        while let Some(joined) = gets.join_next().await {
            let (i, answer) =
                joined.map_err(|e| format!("devhost DRA driver {}: a claim read failed: {e}", self.driver))?;
            got[i] = answer;
        }
        // The first claim (in the kubelet's order) that could not be read fails the call.
        let mut read = Vec::with_capacity(claims.len());
        for (claim, answer) in claims.into_iter().zip(got) {
            read.push((claim, answer?));
        }
        let mut checkpoint = self.checkpoint.lock().await;
        let mut answers = Vec::with_capacity(read.len());
        for (claim, got) in read {
            let answer = self.prepare_one(&mut checkpoint, &claim, got).await.map_err(|why| {
                let error =
                    format!("devhost DRA driver {}: cannot prepare claim {}: {why}", self.driver, claim.shown());
                tracing::warn!(dra_driver = %self.driver, claim = %claim.shown(), "{error}");
                error
            });
            self.metrics.dra_claim_call(&self.resource.config.name, "prepare", answer.is_ok(), checkpoint.claims.len());
            answers.push((claim.uid, answer));
        }
        Ok(answers)
    }

    /// Prepares one claim: the devices the scheduler allocated, checked against what this
    /// driver holds prepared, their CDI spec written and the claim kept in the checkpoint.
    async fn prepare_one(
        &self,
        checkpoint: &mut Checkpoint,
        claim: &ClaimRef,
        got: Result<Allocation, String>,
    ) -> Prepared {
        if let Some(known) = checkpoint.claims.get(&claim.uid) {
            return self.answer_again(known, claim);
        }
        let Allocation { results, pods, configs } = got?;
        let view = self.resource.snapshot();
        let planned = prepare::plan(
            &self.driver,
            &self.api.node,
            self.resource.config.dra_taint_effect,
            &view.devices,
            &results,
        )?;
        check_room(checkpoint, &planned, claim)?;
        let mut prepared = self.new_claim(claim, &planned, pods);
        if !planned.is_empty() {
            let requests: Vec<String> =
                results.iter().filter(|r| r.driver == self.driver).map(|r| r.request.clone()).collect();
            let parameters = parameters::for_driver(&self.driver, &configs, &requests)?;
            self.add_cdi(&mut prepared, &planned, &view, claim, parameters).await?;
        }
        self.keep(checkpoint, claim, prepared)
    }

    /// A claim prepared before: the same answer without calling the driver again, its CDI spec
    /// written again if it is gone.
    fn answer_again(&self, known: &PreparedClaim, claim: &ClaimRef) -> Prepared {
        if let (Some(path), Some(content)) = (&known.cdi_spec, &known.cdi_spec_content)
            && !path.exists()
        {
            claim_spec::write(path, content).map_err(|e| e.to_string())?;
            tracing::info!(dra_driver = %self.driver, claim = %claim.shown(), path = %path.display(),
                "DRA: wrote the CDI spec of an already prepared claim again (it was gone)");
        }
        Ok(known.devices.clone())
    }

    /// The claim as the checkpoint keeps it, before its CDI names are known.
    fn new_claim(&self, claim: &ClaimRef, planned: &[prepare::Planned], pods: Vec<String>) -> PreparedClaim {
        PreparedClaim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            devices: planned
                .iter()
                .map(|p| PreparedDevice {
                    id: p.id.clone(),
                    requests: p.requests.clone(),
                    pool: self.api.node.clone(),
                    device: p.device.clone(),
                    cdi_device_ids: Vec::new(),
                    admin_access: p.admin_access,
                })
                .collect(),
            cdi_spec: None,
            cdi_spec_content: None,
            pods,
        }
    }

    /// Composes the devices' container edits (the driver's allocate hook included, handed the
    /// claim's `parameters`), writes the claim's CDI spec and names its devices in `prepared`.
    async fn add_cdi(
        &self,
        prepared: &mut PreparedClaim,
        planned: &[prepare::Planned],
        view: &View,
        claim: &ClaimRef,
        parameters: String,
    ) -> Result<(), String> {
        let Some(driver) = &self.resource.driver else {
            return Err(format!("the driver of resource {} is not loaded", self.resource.config.name));
        };
        parameters::check_reader(&self.driver, &driver.module, &parameters)?;
        let ids: Vec<String> = planned.iter().map(|p| p.id.clone()).collect();
        let ask = compose::Ask { physical: &ids, cdi_names: false, through_cdi: false, parameters: Some(parameters) };
        let total = compose::compose(&self.resource.config.name, view, ask, driver, &self.metrics)
            .await
            .map_err(|e| e.to_string())?;
        let own: Vec<(String, &crate::driver::device::Edits)> = planned
            .iter()
            .filter_map(|p| {
                let device = view.physical(&p.id)?;
                Some((claim_spec::claim_device_name(&claim.uid, &p.device), &device.edits))
            })
            .collect();
        let entries = claim_spec::split(&own, &total);
        if let Some(content) = claim_spec::render(&self.driver, &entries) {
            let path = claim_spec::path(&self.cdi_dir, &self.driver, &claim.uid);
            claim_spec::write(&path, &content).map_err(|e| e.to_string())?;
            for (device, (_, edits)) in prepared.devices.iter_mut().zip(&entries) {
                let empty = edits.device_nodes.is_empty() && edits.mounts.is_empty() && edits.envs.is_empty();
                if !empty {
                    device.cdi_device_ids.push(claim_spec::qualified_name(&self.driver, &claim.uid, &device.device));
                }
            }
            prepared.cdi_spec = Some(path);
            prepared.cdi_spec_content = Some(content);
        }
        // CDI names the driver declared itself (a spec of its own) go to the first device.
        if let Some(first) = prepared.devices.first_mut() {
            for name in total.cdi_devices {
                if !first.cdi_device_ids.contains(&name) {
                    first.cdi_device_ids.push(name);
                }
            }
        }
        if !total.annotations.is_empty() {
            tracing::debug!(dra_driver = %self.driver, claim = %claim.shown(),
                "DRA: container annotations of the devices or the allocate hook are not delivered (CDI has no annotation edit)");
        }
        Ok(())
    }

    /// Keeps `prepared` in the checkpoint, on disk before the answer goes out; if it cannot be
    /// saved, the claim is not prepared and its CDI spec is removed again.
    fn keep(&self, checkpoint: &mut Checkpoint, claim: &ClaimRef, prepared: PreparedClaim) -> Prepared {
        let devices = prepared.devices.clone();
        let spec = prepared.cdi_spec.clone();
        checkpoint.claims.insert(claim.uid.clone(), prepared);
        if let Err(e) = checkpoint.save() {
            checkpoint.claims.remove(&claim.uid);
            if let Some(path) = &spec {
                let _ = claim_spec::remove(path);
            }
            return Err(format!("cannot keep it in the checkpoint: {e}"));
        }
        let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
        tracing::info!(dra_driver = %self.driver, claim = %claim.shown(), devices = %ids.join(","),
            "DRA: prepared a claim");
        Ok(devices)
    }

    /// Unprepares `claims`: `Ok` for each one that is (now) unprepared, including claims this
    /// driver never prepared; an error names the claim and the driver's message.
    pub async fn unprepare(&self, claims: Vec<ClaimRef>) -> Vec<(String, Result<(), String>)> {
        let mut checkpoint = self.checkpoint.lock().await;
        let mut answers = Vec::with_capacity(claims.len());
        for claim in claims {
            let answer = self.unprepare_one(&mut checkpoint, &claim).await.map_err(|why| {
                let error =
                    format!("devhost DRA driver {}: cannot unprepare claim {}: {why}", self.driver, claim.shown());
                tracing::warn!(dra_driver = %self.driver, claim = %claim.shown(), "{error}");
                error
            });
            self.metrics.dra_claim_call(
                &self.resource.config.name,
                "unprepare",
                answer.is_ok(),
                checkpoint.claims.len(),
            );
            answers.push((claim.uid, answer));
        }
        answers
    }

    /// The DRA driver's name.
    pub(super) fn driver(&self) -> &str {
        &self.driver
    }

    /// The client of the API server the claims are read from.
    pub(super) fn client(&self) -> kube::Client {
        self.api.client.clone()
    }

    /// Every claim prepared now, with the pods it was reserved for.
    pub(super) async fn prepared(&self) -> Vec<(ClaimRef, Vec<String>)> {
        let checkpoint = self.checkpoint.lock().await;
        let claims = checkpoint.claims.iter();
        claims
            .map(|(uid, c)| {
                (ClaimRef { namespace: c.namespace.clone(), uid: uid.clone(), name: c.name.clone() }, c.pods.clone())
            })
            .collect()
    }

    /// Unprepares `claim`, found stale (`why`), as the kubelet's Unprepare would: release hook,
    /// CDI spec, checkpoint. A claim no longer prepared by then is left as it is.
    pub(super) async fn unprepare_stale(&self, claim: &ClaimRef, why: &str) {
        let mut checkpoint = self.checkpoint.lock().await;
        if !checkpoint.claims.get(&claim.uid).is_some_and(|c| c.namespace == claim.namespace && c.name == claim.name) {
            return;
        }
        let done = self.unprepare_one(&mut checkpoint, claim).await;
        let name = &self.resource.config.name;
        // Not a call of the kubelet's: only the stale counter and the prepared gauge move.
        self.metrics.dra_stale_cleanup(name, "claim", done.is_ok());
        self.metrics.dra_prepared(name, checkpoint.claims.len());
        match done {
            Ok(()) => tracing::warn!(dra_driver = %self.driver, claim = %claim.shown(),
                "DRA: unprepared a stale claim by itself ({why}, and no container on this node uses it)"),
            Err(e) => tracing::warn!(dra_driver = %self.driver, claim = %claim.shown(),
                "DRA: cannot unprepare a stale claim ({why}); tried again at the next check: {e}"),
        }
    }

    /// The claim UIDs of this driver's CDI spec files that no prepared claim owns.
    pub(super) async fn orphan_specs(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.cdi_dir) else { return Vec::new() };
        let names: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        let checkpoint = self.checkpoint.lock().await;
        let uids = names.iter().filter_map(|n| claim_spec::uid_of(n, &self.driver));
        uids.filter(|uid| !checkpoint.claims.contains_key(*uid)).map(str::to_owned).collect()
    }

    /// Removes the CDI spec of claim `uid`, which no prepared claim owns and no container uses.
    pub(super) async fn remove_orphan_spec(&self, uid: &str) {
        let checkpoint = self.checkpoint.lock().await;
        if checkpoint.claims.contains_key(uid) {
            return; // prepared meanwhile
        }
        let path = claim_spec::path(&self.cdi_dir, &self.driver, uid);
        let removed = claim_spec::remove(&path);
        self.metrics.dra_stale_cleanup(&self.resource.config.name, "cdi_spec", removed.is_ok());
        match removed {
            Ok(()) => tracing::warn!(dra_driver = %self.driver, path = %path.display(), claim_uid = uid,
                "DRA: removed a stale CDI spec (no prepared claim owns it and no container on this node uses it)"),
            Err(e) => {
                tracing::warn!(dra_driver = %self.driver, claim_uid = uid, "DRA: cannot remove a stale CDI spec: {e}")
            }
        }
    }

    async fn unprepare_one(&self, checkpoint: &mut Checkpoint, claim: &ClaimRef) -> Result<(), String> {
        let Some(known) = checkpoint.claims.get(&claim.uid) else {
            return Ok(());
        };
        let ids = known.device_ids();
        if !ids.is_empty()
            && let Some(driver) = &self.resource.driver
        {
            let releaser = release_hook::DriverReleaser { instance: driver.clone(), metrics: self.metrics.clone() };
            match release_hook::outcome(releaser.release(ids.clone()).await) {
                Outcome::Done => {}
                Outcome::Gone(message) => tracing::info!(dra_driver = %self.driver, claim = %claim.shown(),
                    "DRA: the claim's devices no longer exist; nothing to release: {message}"),
                Outcome::Failed(message) => {
                    return Err(format!("the driver's release hook failed (the kubelet retries): {message}"));
                }
            }
        }
        if let Some(path) = &known.cdi_spec {
            claim_spec::remove(path).map_err(|e| e.to_string())?;
        }
        let removed = checkpoint.claims.remove(&claim.uid);
        if let Err(e) = checkpoint.save() {
            // Still known, so a retry does the rest; the devices are released already.
            if let Some(removed) = removed {
                checkpoint.claims.insert(claim.uid.clone(), removed);
            }
            return Err(format!("cannot drop it from the checkpoint: {e}"));
        }
        tracing::info!(dra_driver = %self.driver, claim = %claim.shown(), devices = %ids.join(","),
            "DRA: unprepared a claim");
        Ok(())
    }
}

/// The answer for a claim that was in the checkpoint when Prepare began but is not any more.
const NOT_READ: &str = "the claim was unprepared while this Prepare call ran; not read from the API server";

/// What reading a claim gave: its allocation, or (inner error) why the claim cannot be prepared
/// as it is; the outer error fails the whole call.
type Read = Result<Result<Allocation, String>, String>;

/// A claim's allocation as Prepare reads it.
#[derive(Clone)]
struct Allocation {
    results: Vec<AllocationResult>,
    /// The pods the claim is reserved for (`status.reservedFor`).
    pods: Vec<String>,
    /// The opaque configuration of the class and the claim.
    configs: Vec<parameters::Config>,
}

/// Reads a claim from the API server (see [`Read`]).
async fn get(client: kube::Client, driver: &str, claim: &ClaimRef) -> Read {
    let api: kube::Api<ResourceClaim> = kube::Api::namespaced(client, &claim.namespace);
    let fail = |why: String| {
        let error = format!("devhost DRA driver {}: cannot read ResourceClaim {}: {why}", driver, claim.shown());
        tracing::warn!(dra_driver = driver, claim = %claim.shown(), "{error}");
        error
    };
    let got = match tokio::time::timeout(GET_TIMEOUT, api.get(&claim.name)).await {
        Ok(Ok(got)) => got,
        Ok(Err(e)) => return Err(fail(e.to_string())),
        Err(_) => return Err(fail(format!("no answer from the API server within {GET_TIMEOUT:?}"))),
    };
    let uid = got.metadata.uid.as_deref().unwrap_or_default();
    if uid != claim.uid {
        return Ok(Err(format!("the claim of that name now has uid {uid}: it got replaced since the kubelet read it")));
    }
    let status = got.status.unwrap_or_default();
    let pods = status.reserved_for.iter().flatten().filter(|r| r.resource == "pods").map(|r| r.name.clone()).collect();
    let Some(allocation) = status.allocation else {
        return Ok(Err("the claim is not allocated (no status.allocation)".to_owned()));
    };
    let devices = allocation.devices.unwrap_or_default();
    let configs = devices.config.as_deref().map(parameters::from_allocation).unwrap_or_default();
    let results = devices.results.unwrap_or_default();
    let results = results
        .into_iter()
        .map(|r| AllocationResult {
            request: r.request,
            driver: r.driver,
            pool: r.pool,
            device: r.device,
            admin_access: r.admin_access.unwrap_or(false),
            tolerations: r.tolerations.iter().flatten().map(Toleration::from).collect(),
        })
        .collect();
    Ok(Ok(Allocation { results, pods, configs }))
}

/// Whether the planned devices are free for `claim` (admin access shares a device with
/// whoever holds it: the scheduler allowed it) and the checkpoint has room for one more claim.
fn check_room(checkpoint: &Checkpoint, planned: &[prepare::Planned], claim: &ClaimRef) -> Result<(), String> {
    for p in planned.iter().filter(|p| !p.admin_access) {
        if let Some((uid, other)) = checkpoint.holder_of(&p.id, &claim.uid) {
            return Err(format!(
                "device {} (ID {}) is prepared for claim {}/{} (uid {uid}), which has not been unprepared",
                p.device, p.id, other.namespace, other.name
            ));
        }
    }
    if checkpoint.claims.len() >= checkpoint::MAX_CLAIMS {
        return Err(format!(
            "{} claims are prepared already, the most one driver keeps; unprepare some first",
            checkpoint::MAX_CLAIMS
        ));
    }
    Ok(())
}
