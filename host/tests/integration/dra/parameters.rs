//! Vendor parameters (ABI 1.3): the opaque config a DeviceClass and a claim carry for devhost's
//! DRA driver, as the allocation on a real API server lists it, reaches the C example driver's
//! allocate hook through `claim_parameters`; what the driver refuses fails that claim's Prepare
//! with its message, naming the claim.

use super::front::{Served, create_claim};
use crate::common::apiserver::ApiServerHarness;

const DRIVER: &str = "gpu.example.com";

/// Writes the claim's allocation, `device` of this driver's pool for request `gpu`, with the
/// opaque config `entries` (source, driver, parameters) as the scheduler copies it from the
/// class and the claim.
fn allocate_with_config(name: &str, device: &str, entries: &[(&str, &str, serde_json::Value)]) {
    let config: Vec<serde_json::Value> = entries
        .iter()
        .map(|(source, driver, parameters)| {
            serde_json::json!({"source": source, "opaque": {"driver": driver, "parameters": parameters}})
        })
        .collect();
    let result = serde_json::json!({"request": "gpu", "driver": DRIVER, "pool": "node-1", "device": device});
    let patch = serde_json::json!({"status": {"allocation": {"devices": {"results": [result], "config": config}}}});
    let patch = patch.to_string();
    let args = ["patch", "resourceclaim", name, "-n", "default", "--subresource=status", "--type=merge", "-p", &patch];
    ApiServerHarness::shared().kubectl(&args);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_parameters_reach_the_drivers_allocate_and_bad_ones_fail_its_prepare() {
    use serde_json::json;
    let greeted = create_claim("params-greeted", 1);
    allocate_with_config(
        "params-greeted",
        "example-0",
        &[
            ("FromClaim", DRIVER, json!({"greeting": "from-claim"})),
            ("FromClass", DRIVER, json!({"greeting": "from-class"})),
            ("FromClaim", "other.example.com", json!({"colour": "not ours"})),
        ],
    );
    let refused = create_claim("params-refused", 1);
    allocate_with_config("params-refused", "example-1", &[("FromClaim", DRIVER, json!({"colour": "red"}))]);
    let mut served = Served::start().await;

    let answer = served.prepare(&[("params-greeted", &greeted)]).await;
    assert_eq!(answer[&greeted].error, "");
    let spec = std::fs::read_to_string(served.spec_path(&greeted)).unwrap();
    assert!(spec.contains("EXAMPLE_GREETING=from-claim"), "the claim's entry overrides the class's: {spec}");
    assert!(!spec.contains("from-class"), "{spec}");

    let answer = served.prepare(&[("params-refused", &refused)]).await;
    let error = &answer[&refused].error;
    assert!(error.contains("default/params-refused"), "names the claim: {error}");
    assert!(error.contains(r#"unknown parameter "colour"; example-c takes only "greeting""#), "{error}");
    assert!(!served.spec_path(&refused).exists(), "nothing is written for a refused claim");
    assert!(!served.checkpoint().contains(&refused), "nor kept");
    served.front.take().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_without_parameters_prepares_as_before() {
    let plain = create_claim("params-none", 1);
    allocate_with_config(
        "params-none",
        "example-0",
        &[("FromClass", "other.example.com", serde_json::json!({"a": 1}))],
    );
    let mut served = Served::start().await;
    assert_eq!(served.prepare(&[("params-none", &plain)]).await[&plain].error, "");
    let spec = std::fs::read_to_string(served.spec_path(&plain)).unwrap();
    assert!(!spec.contains("EXAMPLE_GREETING"), "{spec}");
    assert!(spec.contains("EXAMPLE_ALLOCATED=example-0"), "the allocate hook ran: {spec}");
    served.front.take().unwrap().stop().await;
}
