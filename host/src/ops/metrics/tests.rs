use super::*;
use crate::driver::instance::CallError;
use crate::engine::status::ResourceInfo;
use crate::engine::status::model::ResourceStatus;
use crate::engine::telemetry::{CALL_OUTCOMES, call_outcome};
use std::sync::atomic::{AtomicBool, Ordering};

/// The value of the sample `name` whose labels include every pair of `labels` (any order).
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, label_text) = match series.split_once('{') {
            Some((m, rest)) => (m, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let have: Vec<&str> = label_text.split(',').collect();
        let all = labels.iter().all(|(k, v)| have.contains(&format!("{k}=\"{v}\"").as_str()));
        (metric == name && all).then(|| value.parse().ok())?
    })
}

const R: &str = "example.com/gpu";

fn busy_metrics() -> Metrics {
    let m = Metrics::new();
    m.set_devices(R, 3, 1);
    m.allocation(R, true, Duration::from_micros(700));
    m.allocation(R, true, Duration::from_millis(30));
    m.allocation(R, false, Duration::from_secs(3));
    m.registered(R);
    m.registered(R);
    m.kubelet_restart();
    m.driver_call("nv", "scan", "ok");
    m.driver_call("nv", "allocate", "timeout");
    m.driver_call("nv", "allocate", "timeout");
    m.driver_call("nv", "scan", "panic");
    m.module_load_failure("broken");
    m
}

#[test]
fn every_family_is_exported_with_its_labels_and_values() {
    let text = busy_metrics().encode(false).unwrap();
    let expect = |name: &str, labels: &[(&str, &str)], value: f64| {
        assert_eq!(sample(&text, name, labels), Some(value), "{name}{labels:?} in\n{text}");
    };
    expect("devhost_devices", &[("resource", R), ("health", "healthy")], 3.0);
    expect("devhost_devices", &[("resource", R), ("health", "unhealthy")], 1.0);
    expect("devhost_allocations_total", &[("resource", R), ("outcome", "ok")], 2.0);
    expect("devhost_allocations_total", &[("resource", R), ("outcome", "error")], 1.0);
    expect("devhost_allocate_duration_seconds_count", &[("resource", R)], 3.0);
    expect("devhost_allocate_duration_seconds_bucket", &[("resource", R), ("le", "0.001")], 1.0);
    expect("devhost_allocate_duration_seconds_bucket", &[("resource", R), ("le", "0.05")], 2.0);
    expect("devhost_allocate_duration_seconds_bucket", &[("resource", R), ("le", "+Inf")], 3.0);
    expect("devhost_registrations_total", &[("resource", R)], 2.0);
    expect("devhost_resource_registered", &[("resource", R)], 1.0);
    expect("devhost_kubelet_restarts_total", &[], 1.0);
    expect("devhost_driver_calls_total", &[("driver", "nv"), ("call", "allocate"), ("outcome", "timeout")], 2.0);
    expect("devhost_driver_calls_total", &[("driver", "nv"), ("call", "scan"), ("outcome", "panic")], 1.0);
    expect("devhost_module_load_failures_total", &[("driver", "broken")], 1.0);
    expect("devhost_build_info", &[("version", env!("CARGO_PKG_VERSION"))], 1.0);
    assert!(text.contains("# TYPE devhost_allocate_duration_seconds histogram\n"), "{text}");
    assert!(text.contains("# TYPE devhost_driver_calls_total counter\n"), "{text}");
}

#[test]
fn openmetrics_is_offered_too() {
    let text = busy_metrics().encode(true).unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    assert_eq!(sample(&text, "devhost_kubelet_restarts_total", &[]), Some(1.0));
}

#[test]
fn unregistering_and_forgetting_a_resource() {
    let m = busy_metrics();
    m.unregistered(R);
    assert_eq!(sample(&m.encode(false).unwrap(), "devhost_resource_registered", &[("resource", R)]), Some(0.0));
    m.forget_resource(R);
    let text = m.encode(false).unwrap();
    assert!(!text.contains(R), "{text}");
    assert_eq!(sample(&text, "devhost_driver_calls_total", &[("driver", "nv"), ("outcome", "ok")]), Some(1.0));
}

#[test]
fn call_outcomes_name_the_failure_kind() {
    let driver = "d".to_string();
    let status =
        |code| CallError::Status { driver: driver.clone(), call: "scan", code, status: "X", message: String::new() };
    assert_eq!(call_outcome(&Ok::<(), CallError>(())), "ok");
    assert_eq!(call_outcome::<()>(&Err(status(devhost_abi::DEVHOST_ERR_PANIC))), "panic");
    assert_eq!(call_outcome::<()>(&Err(status(devhost_abi::DEVHOST_ERR_INTERNAL))), "error");
    let timeout = CallError::Timeout { driver: driver.clone(), call: "scan", timeout: Duration::from_secs(1) };
    assert_eq!(call_outcome::<()>(&Err(timeout)), "timeout");
    assert_eq!(call_outcome::<()>(&Err(CallError::Poisoned { driver: driver.clone() })), "refused");
    assert_eq!(call_outcome::<()>(&Err(CallError::Hung { driver, call: "scan", secs: 3 })), "refused");
}

fn flag_probes(ready: Arc<AtomicBool>) -> Probes {
    Probes::new(
        move || if ready.load(Ordering::SeqCst) { Ok(()) } else { Err(vec![R.to_string(), "b.com/x".to_string()]) },
        || {
            let info = ResourceInfo {
                name: R,
                driver: "ex",
                registered: true,
                error: None,
                replicas: 1,
                device_list_strategy: "edits",
            };
            StatusDocument::new(std::time::SystemTime::now(), vec![ResourceStatus::new(info, &[], None)])
        },
    )
}

#[test]
fn readyz_names_unregistered_resources_until_ready() {
    let (m, ready) = (Metrics::new(), Arc::new(AtomicBool::new(false)));
    let probes = flag_probes(ready.clone());
    let a = respond("/readyz", None, &m, &probes);
    assert_eq!(a.status, 503);
    assert!(a.body.contains("example.com/gpu, b.com/x"), "{}", a.body);
    ready.store(true, Ordering::SeqCst);
    assert_eq!(respond("/readyz", None, &m, &probes).status, 200);
}

#[test]
fn healthz_reports_a_failing_liveness_check() {
    let m = Metrics::new();
    let mut probes = flag_probes(Arc::new(AtomicBool::new(true)));
    assert_eq!(respond("/healthz", None, &m, &probes), answer(200, TEXT_TYPE, "ok\n"));
    probes.live = Arc::new(|| Err("registry lock poisoned".into()));
    let a = respond("/healthz", None, &m, &probes);
    assert_eq!((a.status, a.body.as_str()), (503, "unhealthy: registry lock poisoned\n"));
}

#[test]
fn unspecified_bind_addresses_are_reached_on_loopback() {
    assert_eq!(connect_addr("0.0.0.0:9400".parse().unwrap()), "127.0.0.1:9400".parse().unwrap());
    assert_eq!(connect_addr("[::]:9400".parse().unwrap()), "[::1]:9400".parse().unwrap());
    assert_eq!(connect_addr("10.0.0.1:9400".parse().unwrap()), "10.0.0.1:9400".parse().unwrap());
}

#[tokio::test]
async fn the_server_answers_scrapes_and_probes_over_http() {
    let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Arc::new(busy_metrics());
    let ready = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);
    let server = tokio::spawn(serve(listener, metrics.clone(), flag_probes(ready.clone()), stop_rx));

    let scrape = get(addr, "/metrics", &[]).await.unwrap();
    assert_eq!(scrape.status, 200);
    assert!(scrape.headers.contains(&("content-type".into(), "text/plain; version=0.0.4; charset=utf-8".into())));
    assert_eq!(sample(&scrape.body, "devhost_allocations_total", &[("resource", R), ("outcome", "ok")]), Some(2.0));
    metrics.allocation(R, true, Duration::ZERO);
    let again = get(addr, "/metrics", &[("Accept", "application/openmetrics-text;version=1.0.0")]).await.unwrap();
    assert!(again.headers.iter().any(|(k, v)| k == "content-type" && v.starts_with("application/openmetrics-text")));
    assert_eq!(sample(&again.body, "devhost_allocations_total", &[("resource", R), ("outcome", "ok")]), Some(3.0));

    assert_eq!(get(addr, "/healthz", &[]).await.unwrap().status, 200);
    assert_eq!(get(addr, "/readyz", &[]).await.unwrap().status, 503);
    ready.store(true, Ordering::SeqCst);
    assert_eq!(get(addr, "/readyz", &[]).await.unwrap().status, 200);
    let status = get(addr, "/status", &[]).await.unwrap();
    let doc: serde_json::Value = serde_json::from_str(&status.body).unwrap();
    assert_eq!(doc["resources"][0]["resource"], R);
    assert_eq!(get(addr, "/nope", &[]).await.unwrap().status, 404);

    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    raw.read_to_string(&mut text).await.unwrap();
    assert!(text.starts_with("HTTP/1.1 405"), "{text}");

    stop_tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(2), server).await.expect("server stops").unwrap();
    assert!(TcpStream::connect(addr).await.is_err(), "the port is closed after stop");
}

#[tokio::test]
async fn a_taken_port_fails_bind_naming_the_address() {
    let first = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let addr = first.local_addr().unwrap();
    let err = bind(addr).await.unwrap_err();
    assert!(err.to_string().contains(&format!("metrics_addr {addr}")), "{err}");
}

#[test]
fn configured_resources_and_drivers_have_their_series_at_zero_until_something_happens() {
    let m = Metrics::new();
    let info = crate::driver::loader::ModuleInfo {
        name: "nv".into(),
        version: "1".into(),
        description: String::new(),
        abi_major: 1,
        abi_minor: 1,
        allocate: true,
        preferred_allocation: false,
        pre_start: false,
        watch: false,
        release: false,
        concurrent: false,
        claim_parameters: false,
        allocate_claims_only: false,
    };
    m.driver_configured("nv", Some(&info));
    m.driver_configured("broken", None);
    m.resource_configured(R);
    let text = m.encode(false).unwrap();
    assert_eq!(sample(&text, "devhost_resource_registered", &[("resource", R)]), Some(0.0));
    assert_eq!(sample(&text, "devhost_allocations_total", &[("resource", R), ("outcome", "error")]), Some(0.0));
    assert_eq!(sample(&text, "devhost_devices", &[("resource", R), ("health", "unhealthy")]), Some(0.0));
    assert_eq!(sample(&text, "devhost_unhealthy_devices", &[("resource", R)]), Some(0.0));
    assert_eq!(sample(&text, "devhost_module_load_failures_total", &[("driver", "broken")]), Some(0.0));
    for outcome in CALL_OUTCOMES {
        let labels = [("driver", "nv"), ("call", "allocate"), ("outcome", outcome)];
        assert_eq!(sample(&text, "devhost_driver_calls_total", &labels), Some(0.0), "{outcome}");
    }
    // Only the calls the module offers.
    assert_eq!(sample(&text, "devhost_driver_calls_total", &[("driver", "nv"), ("call", "pre_start")]), None);

    // Configuring again (a reload) keeps what was counted; forgetting drops the series.
    m.registered(R);
    m.module_load_failure("broken");
    m.resource_configured(R);
    m.driver_configured("broken", None);
    let text = m.encode(false).unwrap();
    assert_eq!(sample(&text, "devhost_resource_registered", &[("resource", R)]), Some(1.0));
    assert_eq!(sample(&text, "devhost_module_load_failures_total", &[("driver", "broken")]), Some(1.0));
    // A release hook's calls (counted as they happen, not created up front) go with the driver too.
    m.driver_call("nv", "release", "ok");
    m.forget_driver("nv");
    m.forget_resource(R);
    let text = m.encode(false).unwrap();
    assert_eq!(sample(&text, "devhost_driver_calls_total", &[("driver", "nv")]), None);
    assert_eq!(sample(&text, "devhost_resource_registered", &[("resource", R)]), None);
}
