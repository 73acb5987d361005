//! Stale claims: a prepared claim gone from the real API server is unprepared by devhost itself
//! (release hook, CDI spec, checkpoint) once no pod it was reserved for runs and no container
//! lists it in the kubelet's PodResources (the kubelet emulator's pods and `dynamic_resources`),
//! at start and periodically; nothing is touched while the kubelet cannot be asked.

use std::path::{Path, PathBuf};
use std::time::Duration;

use devhost_proto::podresources::v1::{CdiDevice, ClaimResource, DynamicResource};
use kubelet_emu::PodResourcesServer;

use super::front::{Served, allocate, create_claim};
use crate::common::apiserver::ApiServerHarness;
use crate::common::wait::eventually_within;

const DRIVER: &str = "gpu.example.com";

fn socket(dir: &Path) -> PathBuf {
    dir.join("pod-resources").join("kubelet.sock")
}

/// Top-level keys: the kubelet's PodResources socket in `dir`, and the check's interval.
fn keys(interval: &str) -> impl Fn(&Path) -> String {
    let interval = interval.to_owned();
    move |dir| {
        format!("pod_resources_socket = \"{}\"\ndra_claim_check_interval = \"{interval}\"\n", socket(dir).display())
    }
}

/// What the kubelet lists for a container using claim `default/name` (uid `uid`) on `device`.
fn listed(name: &str, uid: &str, device: &str) -> (String, DynamicResource) {
    let claim = DynamicResource {
        claim_name: name.into(),
        claim_namespace: "default".into(),
        claim_resources: vec![ClaimResource {
            cdi_devices: vec![CdiDevice { name: format!("{DRIVER}/claim={uid}-{device}") }],
            driver_name: DRIVER.into(),
            pool_name: "node-1".into(),
            device_name: device.into(),
        }],
    };
    ("app".to_owned(), claim)
}

fn delete_claim(name: &str) {
    ApiServerHarness::shared().kubectl(&["delete", "resourceclaim", name, "-n", "default", "--wait=true"]);
}

const STALE_OK: &str = r#"devhost_dra_stale_claims_total{resource="example.com/gpu",what="claim",outcome="ok"} "#;
const STALE_SPEC_OK: &str =
    r#"devhost_dra_stale_claims_total{resource="example.com/gpu",what="cdi_spec",outcome="ok"} "#;

/// Reserves claim `default/name` for pod `pod`, as the scheduler does before the kubelet prepares.
fn reserve(name: &str, pod: &str) {
    let patch = serde_json::json!({"status": {"reservedFor": [{"resource": "pods", "name": pod, "uid": format!("uid-{pod}")}]}});
    let args = ["patch", "resourceclaim", name, "-n", "default", "--subresource=status", "--type=merge", "-p"];
    let mut args: Vec<&str> = args.to_vec();
    let patch = patch.to_string();
    args.push(&patch);
    ApiServerHarness::shared().kubectl(&args);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_gone_from_the_api_server_is_unprepared_by_itself_once_no_pod_or_container_uses_it() {
    let gone = create_claim("stale-gone", 1);
    allocate("stale-gone", &["example-0"]);
    let reserved = create_claim("stale-reserved", 1);
    allocate("stale-reserved", &["example-1"]);
    reserve("stale-reserved", "runner");
    let mut served = Served::start_with(keys("200ms")).await;
    let pods = PodResourcesServer::start(&socket(served.dir.path())).unwrap();
    pods.set_pod("default", "runner", vec![]);
    let answer = served.prepare(&[("stale-gone", &gone), ("stale-reserved", &reserved)]).await;
    assert!(answer.values().all(|a| a.error.is_empty()), "{answer:?}");
    // Both claims exist: several checks leave them alone.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(served.checkpoint().contains(&gone) && served.checkpoint().contains(&reserved), "{}", served.checkpoint());
    assert_eq!(served.released(), "", "nothing released while the claims exist");

    // stale-gone's pod was force-deleted; the pod stale-reserved was reserved for still runs.
    delete_claim("stale-gone");
    delete_claim("stale-reserved");
    eventually_within("the gone claim unprepared", Duration::from_secs(20), || !served.checkpoint().contains(&gone))
        .await;
    assert_eq!(served.released(), "released example-0\n", "its release hook ran");
    assert!(!served.spec_path(&gone).exists(), "its CDI spec is removed");
    eventually_within("counted", Duration::from_secs(5), || served.metric(STALE_OK) == 1.0).await;
    // A claim without reservation (as devhost's older checkpoints keep them) that a container lists.
    let listed_uid = create_claim("stale-listed", 1);
    allocate("stale-listed", &["example-0"]);
    assert_eq!(served.prepare(&[("stale-listed", &listed_uid)]).await[&listed_uid].error, "");
    pods.set_pod_claims("default", "user", vec![listed("stale-listed", &listed_uid, "example-0")]);
    delete_claim("stale-listed");
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(served.checkpoint().contains(&reserved), "a claim whose pod runs is never touched");
    assert!(served.checkpoint().contains(&listed_uid), "nor one a container lists");
    assert!(served.spec_path(&reserved).exists() && served.spec_path(&listed_uid).exists());

    // The pods go away without an Unprepare: their claims are stale now.
    pods.remove_pod("default", "runner");
    eventually_within("the reserved claim unprepared once its pod is gone", Duration::from_secs(20), || {
        !served.checkpoint().contains(&reserved)
    })
    .await;
    assert_eq!(served.released(), "released example-0\nreleased example-1\n");
    pods.remove_pod("default", "user");
    eventually_within("the listed claim unprepared once its pod is gone", Duration::from_secs(20), || {
        !served.checkpoint().contains(&listed_uid)
    })
    .await;
    assert_eq!(served.released(), "released example-0\nreleased example-1\nreleased example-0\n");
    eventually_within("all three counted", Duration::from_secs(5), || served.metric(STALE_OK) == 3.0).await;
    // The kubelet's late Unprepare finds nothing left to do.
    assert_eq!(served.unprepare("stale-gone", &gone).await, "");
    assert_eq!(served.released().lines().count(), 3, "released once each");
    served.front.take().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_start_a_replaced_claim_and_an_unowned_spec_are_cleaned_up_only_once_the_kubelet_can_be_asked() {
    let old = create_claim("stale-replaced", 1);
    allocate("stale-replaced", &["example-0"]);
    // A long interval: only the check at start can find them.
    let mut served = Served::start_with(keys("60m")).await;
    assert_eq!(served.prepare(&[("stale-replaced", &old)]).await[&old].error, "");
    served.front.take().unwrap().stop().await;
    // While devhost is down the claim is deleted and a new claim of that name is made.
    delete_claim("stale-replaced");
    let new = create_claim("stale-replaced", 1);
    assert_ne!(new, old);
    // Two spec files of this driver no claim owns (a checkpoint lost, say): one a container uses.
    let cdi = served.dir.path().join("cdi");
    let (unowned, in_use) = (
        cdi.join(format!("devhost.dra_{DRIVER}_u-orphan.json")),
        cdi.join(format!("devhost.dra_{DRIVER}_u-used.json")),
    );
    std::fs::write(&unowned, "{}").unwrap();
    std::fs::write(&in_use, "{}").unwrap();
    let other = cdi.join("vendor.yaml");
    std::fs::write(&other, "{}").unwrap();

    // No PodResources socket: nothing is touched.
    let served = served.restart().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(served.checkpoint().contains(&old), "{}", served.checkpoint());
    assert!(unowned.exists() && in_use.exists());
    assert_eq!(served.released(), "");

    let pods = PodResourcesServer::start(&socket(served.dir.path())).unwrap();
    pods.set_pod_claims("default", "user", vec![listed("elsewhere", "u-used", "example-1")]);
    let mut served = served.restart().await;
    eventually_within("the replaced claim unprepared at start", Duration::from_secs(20), || {
        !served.checkpoint().contains(&old) && !unowned.exists()
    })
    .await;
    assert_eq!(served.released(), "released example-0\n");
    assert!(!served.spec_path(&old).exists());
    assert!(in_use.exists(), "a spec whose CDI device a container uses is kept");
    assert!(other.exists(), "another vendor's spec is not ours to remove");
    eventually_within("counted", Duration::from_secs(5), || {
        served.metric(STALE_OK) == 1.0 && served.metric(STALE_SPEC_OK) == 1.0
    })
    .await;
    // The new claim of that name prepares as any claim does.
    allocate("stale-replaced", &["example-0"]);
    assert_eq!(served.prepare(&[("stale-replaced", &new)]).await[&new].error, "");
    served.front.take().unwrap().stop().await;
}
