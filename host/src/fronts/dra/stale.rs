//! Stale claims: prepared claims nobody will unprepare. A pod force-deleted, a node rebooted
//! while its pods went away, an Unprepare that never came: the claim's devices stay held in the
//! checkpoint, and its CDI spec stays in the runtime's folder. So, once when the driver starts
//! and then every `dra_claim_check_interval`, each prepared claim is read from the API server by
//! namespace and name. A claim that is gone there (not found, or the name now belongs to a claim
//! with another UID) is unprepared as the kubelet's Unprepare would do it (release hook, CDI
//! spec, checkpoint) once the kubelet's PodResources shows that none of the pods it was reserved
//! for at Prepare still runs on the node and that no container lists it in `dynamic_resources`.
//! (The pods matter: a claim removed from under a running pod gets a successor from the claim
//! controller, and the kubelet then names the successor, not the prepared claim.) A CDI spec of
//! this driver that no prepared claim owns and whose CDI devices no container uses is removed too.
//!
//! Nothing is touched on doubt: a claim the API server did not answer for, any claim while the
//! kubelet cannot be asked, and a claim whose pod runs or that a container lists stay as they are.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::claim_spec;
use super::claims::{ClaimRef, Claims, GET_TIMEOUT, Settings};
use crate::engine::podresources::{self, TrackedClaims};

/// GETs in flight at once (a checkpoint holds up to 4096 claims).
const GETS_AT_ONCE: usize = 16;

/// Checks `claims` for stale ones now and then every `settings.claim_check_interval`, until `stop`.
pub(super) fn spawn(claims: Arc<Claims>, settings: &Settings, mut stop: watch::Receiver<bool>) -> JoinHandle<()> {
    let socket = settings.pod_resources_socket.clone();
    let interval = settings.claim_check_interval;
    tokio::spawn(async move {
        let mut check = Check { claims, socket, kubelet_error: None, kept: BTreeSet::new() };
        loop {
            check.round().await;
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.wait_for(|stopped| *stopped) => return,
            }
        }
    })
}

struct Check {
    claims: Arc<Claims>,
    socket: PathBuf,
    /// Why the kubelet could not be asked last time, so that a lasting failure is logged once.
    kubelet_error: Option<String>,
    /// The claims already logged as kept because a container lists them (logged once each).
    kept: BTreeSet<String>,
}

impl Check {
    /// One look at every prepared claim and every spec file of the driver.
    async fn round(&mut self) {
        let prepared = self.claims.prepared().await;
        // Claims unprepared since need no "kept" line any more: the set stays the checkpoint's size.
        self.kept.retain(|uid| prepared.iter().any(|(c, _)| &c.uid == uid));
        let gone = gone_from_api(&self.claims, prepared).await;
        let orphans = self.claims.orphan_specs().await;
        if gone.is_empty() && orphans.is_empty() {
            return;
        }
        let Some(tracked) = self.ask_kubelet(gone.len() + orphans.len()).await else { return };
        for (claim, pods, why) in gone {
            if let Some(user) = in_use(&tracked, &claim, &pods) {
                if self.kept.insert(claim.uid.clone()) {
                    tracing::info!(dra_driver = %self.claims.driver(), claim = %claim.shown(),
                        "DRA: a claim gone from the API server stays prepared: {user} ({why})");
                }
                continue;
            }
            self.claims.unprepare_stale(&claim, &why).await;
        }
        for uid in orphans {
            if !uses_spec_of(&tracked, self.claims.driver(), &uid) {
                self.claims.remove_orphan_spec(&uid).await;
            }
        }
    }

    /// The claims the kubelet's containers use, or `None` (logged once while it lasts) when the
    /// kubelet cannot be asked: then nothing is touched.
    async fn ask_kubelet(&mut self, waiting: usize) -> Option<TrackedClaims> {
        match podresources::tracked_claims(&self.socket).await {
            Ok(tracked) => {
                if self.kubelet_error.take().is_some() {
                    tracing::info!(dra_driver = %self.claims.driver(), socket = %self.socket.display(),
                        "DRA: the kubelet's PodResources answers again; stale claims are cleaned up");
                }
                Some(tracked)
            }
            Err(e) => {
                let text = e.to_string();
                if self.kubelet_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(dra_driver = %self.claims.driver(), stale = waiting,
                        "DRA: stale claims or CDI specs are left as they are: the kubelet cannot be asked \
                         which claims its containers use ({text}); mount the kubelet's pod-resources folder");
                }
                self.kubelet_error = Some(text);
                None
            }
        }
    }
}

/// Who on the node may still use `claim`, reserved for `pods` when it was prepared: a pod of
/// those the kubelet still runs, or a container listing the claim itself.
fn in_use(tracked: &TrackedClaims, claim: &ClaimRef, pods: &[String]) -> Option<String> {
    if let Some(pod) = pods.iter().find(|p| tracked.runs(&claim.namespace, p)) {
        return Some(format!("pod {}/{pod}, which it was reserved for, still runs on this node", claim.namespace));
    }
    tracked.tracks(&claim.namespace, &claim.name).then(|| "a container on this node still lists it".to_owned())
}

/// Whether a container uses a CDI device of the spec of claim `uid`.
fn uses_spec_of(tracked: &TrackedClaims, driver: &str, uid: &str) -> bool {
    let prefix = format!("{}={uid}-", claim_spec::kind(driver));
    tracked.cdi_devices.iter().any(|name| name.starts_with(&prefix))
}

/// A prepared claim with the pods it was reserved for, and (when gone) why.
type Candidate = (ClaimRef, Vec<String>);

/// The claims of `prepared` that the API server says are gone, each with its pods and why.
async fn gone_from_api(claims: &Claims, prepared: Vec<Candidate>) -> Vec<(ClaimRef, Vec<String>, String)> {
    let mut gone = Vec::new();
    let mut unknown: Option<String> = None;
    for batch in prepared.chunks(GETS_AT_ONCE) {
        let mut gets = tokio::task::JoinSet::new();
        for (claim, pods) in batch.iter().cloned() {
            let client = claims.client();
            gets.spawn(async move {
                let found = look_up(client, &claim).await;
                (claim, pods, found)
            });
        }
        while let Some(Ok((claim, pods, found))) = gets.join_next().await {
            match found {
                Found::Same => {}
                Found::Gone(why) => gone.push((claim, pods, why)),
                Found::Unknown(why) => unknown = Some(format!("{}/{}: {why}", claim.namespace, claim.name)),
            }
        }
    }
    if let Some(why) = unknown {
        tracing::debug!(dra_driver = %claims.driver(), "DRA: some claims could not be checked this time, e.g. {why}");
    }
    gone
}

/// What the API server said of a prepared claim.
enum Found {
    /// It is there, with the same UID.
    Same,
    /// It is gone: why.
    Gone(String),
    /// No telling (an error, no answer): why.
    Unknown(String),
}

async fn look_up(client: kube::Client, claim: &ClaimRef) -> Found {
    let api: kube::Api<ResourceClaim> = kube::Api::namespaced(client, &claim.namespace);
    match tokio::time::timeout(GET_TIMEOUT, api.get_opt(&claim.name)).await {
        Ok(Ok(None)) => Found::Gone("the API server has no ResourceClaim of that name".to_owned()),
        Ok(Ok(Some(got))) => match got.metadata.uid.as_deref() {
            Some(uid) if uid == claim.uid => Found::Same,
            uid => Found::Gone(format!(
                "the ResourceClaim of that name is another claim now (uid {})",
                uid.unwrap_or("none")
            )),
        },
        Ok(Err(e)) => Found::Unknown(e.to_string()),
        Err(_) => Found::Unknown(format!("no answer within {GET_TIMEOUT:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_is_in_use_when_a_container_lists_one_of_its_cdi_devices() {
        let mut tracked = TrackedClaims::default();
        tracked.cdi_devices.insert("gpu.example.com/claim=u1-gpu-0".to_owned());
        tracked.cdi_devices.insert("other.example.com/claim=u2-gpu-0".to_owned());
        assert!(uses_spec_of(&tracked, "gpu.example.com", "u1"));
        assert!(!uses_spec_of(&tracked, "gpu.example.com", "u2"), "another driver's device of that claim");
        assert!(!uses_spec_of(&tracked, "gpu.example.com", "u"), "a UID is matched whole");
    }

    #[test]
    fn a_gone_claim_is_in_use_while_a_pod_it_was_reserved_for_runs_or_a_container_lists_it() {
        let mut tracked = TrackedClaims::default();
        tracked.pods.insert(("ns".to_owned(), "web".to_owned()));
        let claim = ClaimRef { namespace: "ns".into(), uid: "u".into(), name: "c".into() };
        let web = in_use(&tracked, &claim, &["gone".into(), "web".into()]).unwrap();
        assert_eq!(web, "pod ns/web, which it was reserved for, still runs on this node");
        assert_eq!(in_use(&tracked, &claim, &["gone".into()]), None);
        let other_ns = ClaimRef { namespace: "other".into(), ..claim.clone() };
        assert_eq!(in_use(&tracked, &other_ns, &["web".into()]), None, "a pod of the claim's namespace");
        tracked.claims.insert(("ns".to_owned(), "c".to_owned()));
        assert_eq!(in_use(&tracked, &claim, &[]).as_deref(), Some("a container on this node still lists it"));
    }
}
