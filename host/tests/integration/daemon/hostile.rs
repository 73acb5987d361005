//! Hostile drivers and hostile kubelet input: every misbehaviour stays in
//! its own resource, gets a clear log line, and never a wrong success.

use crate::common::*;
use devhost_proto::v1beta1 as pb;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn hostile_so(node: &Node) -> PathBuf {
    let so = node.path().join("libhostile.so");
    compile_c(&repo_root().join("tests/fixtures/hostile_driver.c"), &so, &abi_include());
    so
}

/// A daemon serving `example.com/good` (the C example) next to
/// `example.com/bad` built from `bad_driver` (a `[driver.bad]` body).
async fn start(node: &Node, bad_driver: &str) -> (Kubelet, Daemon) {
    let m = node.write_manifest(&format!(
        r#"
[driver.good]
module = "{good}"
options = {{ count = 2 }}
[driver.bad]
{timeout}
{bad_driver}
[[resource]]
name = "example.com/good"
driver = "good"
[[resource]]
name = "example.com/bad"
driver = "bad"
"#,
        good = module("example_c").display(),
        timeout = if bad_driver.contains("call_timeout") { "" } else { "call_timeout = \"500ms\"" },
    ));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    if let Err(e) = kubelet.wait_devices("example.com/good", WAIT, |x| x.len() == 2).await {
        panic!("{e}\ndaemon log:\n{}", d.logs());
    }
    (kubelet, d)
}

async fn good_still_allocates(kubelet: &Kubelet) {
    let r = kubelet.allocate("example.com/good", vec![vec!["example-1".into()]]).await.unwrap();
    assert_eq!(env_of(&r, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_any_entry_point_stays_in_its_resource() {
    // In process, a panic disables the instance until a reload (an isolated
    // worker restarts instead: see isolation/instance.rs).
    for call in ["create", "scan", "allocate", "preferred", "pre_start", "watch_start"] {
        let node = Node::new();
        let bad = format!(
            "module = \"{}\"\nisolation = \"in-process\"\noptions = {{ panic_in = \"{call}\" }}",
            module("testdrv").display()
        );
        let (kubelet, d) = start(&node, &bad).await;
        if call == "create" {
            let log = d.wait_log("not served", WAIT).await;
            assert!(log.contains("told to panic in create"), "{log}");
            assert!(!kubelet.resources().contains(&"example.com/bad".to_string()));
            good_still_allocates(&kubelet).await;
            continue;
        }
        if call == "watch_start" {
            // Poisoned before its first scan: the resource is served with no devices.
            d.wait_log("told to panic in watch_start", WAIT).await;
            let devs = kubelet.wait_devices("example.com/bad", WAIT, |_| true).await.unwrap();
            assert!(devs.iter().all(|d| d.health != "Healthy"), "{devs:?}");
            d.wait_log("scan failed, its devices are reported Unhealthy", WAIT).await;
            good_still_allocates(&kubelet).await;
            continue;
        }
        kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 4).await.unwrap();
        let ids: Vec<String> = (0..4).map(|i| format!("t-{i}")).collect();
        match call {
            "allocate" => {
                let err = kubelet.allocate("example.com/bad", vec![vec!["t-0".into()]]).await.unwrap_err();
                assert_eq!(err.code(), tonic::Code::Internal, "{}", err.message());
            }
            "pre_start" => {
                let err = kubelet.pre_start("example.com/bad", vec!["t-0".into()]).await.unwrap_err();
                assert_eq!(err.code(), tonic::Code::Internal, "{}", err.message());
            }
            "preferred" => {
                // The host's own answer stands in for the broken hook.
                let got = kubelet.preferred_allocation("example.com/bad", ids, vec![], 2).await.unwrap();
                assert_eq!(got.len(), 2);
            }
            // The first scan is always clean; a reload rescans.
            // SAFETY: kill(2) on our own child.
            "scan" => unsafe {
                libc::kill(d.child.id() as i32, libc::SIGHUP);
            },
            _ => {}
        }
        d.wait_log(&format!("told to panic in {call}"), WAIT).await;
        kubelet
            .wait_devices("example.com/bad", WAIT, |x| !x.is_empty() && x.iter().all(|d| d.health == "Unhealthy"))
            .await
            .unwrap_or_else(|e| panic!("{call}: {e}"));
        good_still_allocates(&kubelet).await;
        assert!(d.logs().contains("driver=bad"), "{call}: the log names the driver");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_in_scan_hits_the_deadline_and_only_its_devices_go_unhealthy() {
    let node = Node::new();
    let bad = format!(
        "module = \"{}\"\npoll_interval = \"200ms\"\noptions = {{ hang_in = \"scan\", hang_ms = 2500 }}",
        module("testdrv").display()
    );
    let (kubelet, d) = start(&node, &bad).await;
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 4).await.unwrap();
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.iter().all(|d| d.health == "Unhealthy")).await.unwrap();
    d.wait_log("scan did not return within 500ms", WAIT).await;
    let start = Instant::now();
    good_still_allocates(&kubelet).await;
    assert!(start.elapsed() < Duration::from_millis(500), "the host stayed responsive");
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.iter().all(|d| d.health == "Healthy")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_ids_are_dropped_with_a_log_line_and_the_rest_is_served() {
    let node = Node::new();
    let bad = format!("module = \"{}\"\noptions = {{ bad_ids = true, count = 2 }}", module("testdrv").display());
    let (kubelet, d) = start(&node, &bad).await;
    let devs = kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 2).await.unwrap();
    assert_eq!(devs.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["t-0", "t-1"]);
    let log = d.wait_log("duplicate ID", WAIT).await;
    for why in ["empty device ID", "longer than 63 bytes", "spaces or non-printable", "reserved \"::\""] {
        assert!(log.contains(why), "missing {why:?} in:\n{log}");
    }
    assert!(log.contains("driver=bad") || log.contains("driver=\"bad\""), "the log names the driver:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8_and_null_pointers_are_refused_without_harm() {
    for mode in ["bad_utf8", "null_ptrs"] {
        let node = Node::new();
        let so = hostile_so(&node);
        let bad = format!("module = \"{}\"\noptions = {{ mode = \"{mode}\" }}", so.display());
        let (kubelet, d) = start(&node, &bad).await;
        let devs = kubelet.wait_devices("example.com/bad", WAIT, |x| !x.is_empty()).await.unwrap();
        assert_eq!(devs.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["good-0"], "{mode}");
        let log = d.wait_log("not valid UTF-8 (or NULL)", WAIT).await;
        assert!(log.contains("driver emitted bad data"), "{log}");
        good_still_allocates(&kubelet).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_status_codes_become_internal() {
    let node = Node::new();
    let so = hostile_so(&node);
    let (kubelet, d) =
        start(&node, &format!("module = \"{}\"\noptions = {{ mode = \"bad_status\" }}", so.display())).await;
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 1).await.unwrap();
    let err = kubelet.allocate("example.com/bad", vec![vec!["dev-0".into()]]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal);
    assert!(err.message().contains("unknown status code 777"), "{}", err.message());
    // Trigger a rescan: the failing scan turns the device Unhealthy.
    // SAFETY: kill(2) on our child; SIGHUP reloads an unchanged manifest, which rescans.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGHUP) };
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.iter().all(|d| d.health == "Unhealthy")).await.unwrap();
    d.wait_log("unknown status code 12345", WAIT).await;
    good_still_allocates(&kubelet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_devices_changed_storm_is_coalesced_and_the_host_stays_responsive() {
    let node = Node::new();
    let so = hostile_so(&node);
    let (kubelet, d) =
        start(&node, &format!("module = \"{}\"\noptions = {{ mode = \"storm\", count = 3 }}", so.display())).await;
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 3).await.unwrap();
    for _ in 0..20 {
        let t = Instant::now();
        good_still_allocates(&kubelet).await;
        assert!(t.elapsed() < Duration::from_millis(500), "allocate took {:?} during the storm", t.elapsed());
    }
    // 800,000 notifications from four threads; far fewer scans.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let scans = d.logs().lines().filter(|l| l.contains("scanned") && l.contains("driver=bad")).count();
    assert!(scans >= 1, "the storm must cause rescans");
    assert!(scans < 10_000, "{scans} scans for 800,000 notifications: not coalesced");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_edits_keep_the_first_device_and_log_the_other() {
    let node = Node::new();
    let so = hostile_so(&node);
    let (kubelet, d) =
        start(&node, &format!("module = \"{}\"\noptions = {{ mode = \"conflict\" }}", so.display())).await;
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 2).await.unwrap();
    let r = kubelet.allocate("example.com/bad", vec![vec!["c-1".into(), "c-0".into()]]).await.unwrap();
    let nodes = &r.container_responses[0].devices;
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].host_path, "/dev/zero", "the first device in request order wins");
    d.wait_log("conflicting container edits", WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_many_conflicting_devices_logs_a_few_and_counts_the_rest() {
    let node = Node::new();
    let so = hostile_so(&node);
    let (kubelet, d) =
        start(&node, &format!("module = \"{}\"\noptions = {{ mode = \"conflict\", count = 500 }}", so.display())).await;
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 500).await.unwrap();
    let ids: Vec<String> = (0..500).map(|i| format!("c-{i}")).collect();
    let r = kubelet.allocate("example.com/bad", vec![ids]).await.unwrap();
    let nodes = &r.container_responses[0].devices;
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].host_path, "/dev/null", "the first device in request order wins");
    d.wait_log("499 in all", WAIT).await;
    let logs = d.logs();
    let lines: Vec<&str> = logs.lines().filter(|l| l.contains("conflicting container edits")).collect();
    assert_eq!(lines.len(), devhost::driver::device::Conflicts::SHOWN + 1, "{lines:#?}");
    assert!(
        lines[0].contains("device c-1: device node /dev/zero -> /dev/shared conflicts with /dev/null"),
        "{lines:#?}"
    );
    let more = devhost::driver::device::Conflicts::SHOWN;
    assert!(lines[more].contains(&format!("{} more in this request (499 in all", 499 - more)), "{lines:#?}");
    good_still_allocates(&kubelet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn millions_of_devices_are_capped_and_the_host_survives() {
    let node = Node::new();
    let so = hostile_so(&node);
    let (kubelet, d) = start(
        &node,
        &format!(
            "module = \"{}\"\ncall_timeout = \"30s\"\noptions = {{ mode = \"millions\", count = 2000000 }}",
            so.display()
        ),
    )
    .await;
    let devs = kubelet.wait_devices("example.com/bad", Duration::from_secs(60), |x| !x.is_empty()).await.unwrap();
    assert_eq!(devs.len(), 100_000);
    d.wait_log("more than 100000 devices in one scan", WAIT).await;
    good_still_allocates(&kubelet).await;
}

// ---- hostile kubelet input -------------------------------------------------

async fn raw(kubelet: &Kubelet, r: &str) -> pb::device_plugin_client::DevicePluginClient<tonic::transport::Channel> {
    kubelet.client(r).expect("registered")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_allocate_requests_get_precise_errors() {
    let node = Node::new();
    let (kubelet, _d) = start(&node, &format!("module = \"{}\"", module("testdrv").display())).await;
    kubelet.wait_devices("example.com/bad", WAIT, |x| x.len() == 4).await.unwrap();
    let mut c = raw(&kubelet, "example.com/good").await;
    let req = |containers: Vec<Vec<String>>| pb::AllocateRequest {
        container_requests: containers
            .into_iter()
            .map(|ids| pb::ContainerAllocateRequest { devices_ids: ids })
            .collect(),
    };
    let cases: Vec<(Vec<Vec<String>>, &str)> = vec![
        (vec![], "no container requests"),
        (vec![vec![]], "container request 0 has no device IDs"),
        (vec![vec!["example-0".into(), "example-0".into()]], "device ID \"example-0\" requested twice"),
        (vec![vec!["example-0".into()], vec!["t-1".into()]], "unknown device ID \"t-1\""),
        (
            (0..100_000)
                .map(|i| vec![format!("x{i}")])
                .take(1)
                .chain(std::iter::once(vec!["example-0".into()]))
                .collect(),
            "unknown device ID \"x0\"",
        ),
    ];
    for (containers, want) in cases {
        let err = c.allocate(req(containers)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{want}");
        assert!(err.message().contains(want), "wanted {want:?}, got {:?}", err.message());
    }
    // Large requests are counted before they are decoded: more IDs than the resource advertises
    // cannot be valid.
    let many: Vec<String> = (0..100_000).map(|i| format!("example-{}", i % 2)).collect();
    let err = c.allocate(req(vec![many])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("names 100000 device IDs, more than the 2"), "{}", err.message());
    let many: Vec<String> = (0..100_000).map(|i| format!("nope-{i}")).collect();
    let err = c.allocate(req(vec![many])).await.unwrap_err();
    assert!(err.message().contains("names 100000 device IDs"), "{}", err.message());
    // A long unknown ID is quoted by its first bytes and its length, in a large request or not.
    for len in [1_000, 3_000_000] {
        let err = c.allocate(req(vec![vec!["q".repeat(len)]])).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().len() < 200, "{len}: {} bytes of error", err.message().len());
        let want = if len > 64 << 10 { format!("device ID of {len} bytes") } else { format!("…({len} bytes)") };
        assert!(err.message().contains(&want), "{}", err.message());
    }
    // A message over the kubelet's 4 MiB is refused before it is read.
    let err = c.allocate(req(vec![vec!["q".repeat(5 << 20)]])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{}", err.message());
    assert!(err.message().contains("larger than the limit of 4194304 bytes"), "{}", err.message());
    // Nothing was allocated by the failed calls, and a good one still works.
    good_still_allocates(&kubelet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_preferred_allocation_requests_get_precise_errors() {
    let node = Node::new();
    let (kubelet, _d) = start(&node, &format!("module = \"{}\"", module("testdrv").display())).await;
    let mut c = raw(&kubelet, "example.com/good").await;
    let all = vec!["example-0".to_string(), "example-1".to_string()];
    let req = |avail: Vec<String>, must: Vec<String>, size: i32| pb::PreferredAllocationRequest {
        container_requests: vec![pb::ContainerPreferredAllocationRequest {
            available_device_i_ds: avail,
            must_include_device_i_ds: must,
            allocation_size: size,
        }],
    };
    let cases = vec![
        (req(all.clone(), vec![], 3), "allocation_size 3 is larger than the 2 available devices"),
        (req(all.clone(), vec!["t-0".into()], 1), "must-include device \"t-0\" is not among the available devices"),
        (req(all.clone(), vec![], -1), "allocation_size -1 is negative"),
        (req(vec!["ghost".into()], vec![], 1), "unknown device ID \"ghost\""),
        (req(vec!["g".repeat(500)], vec![], 1), "unknown device ID \"gggggggg"),
        (req(all.clone(), vec!["m".repeat(500)], 1), "…(500 bytes) is not among the available devices"),
        (pb::PreferredAllocationRequest { container_requests: vec![] }, "no container requests"),
    ];
    for (r, want) in cases {
        let err = c.get_preferred_allocation(r).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{want}");
        assert!(err.message().contains(want), "wanted {want:?}, got {:?}", err.message());
    }
    let ok = c.get_preferred_allocation(req(all, vec!["example-1".into()], 1)).await.unwrap().into_inner();
    assert_eq!(ok.container_responses[0].device_i_ds, ["example-1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_device_id_in_two_container_requests_of_a_call_is_refused() {
    let node = Node::new();
    let (kubelet, _d) = start(&node, &format!("module = \"{}\"", module("testdrv").display())).await;
    for containers in [
        vec![vec!["example-0".to_string()], vec!["example-0".to_string()]],
        vec![vec!["example-1".to_string()], vec!["example-0".to_string(), "example-1".to_string()]],
    ] {
        let err = kubelet.allocate("example.com/good", containers).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("requested by container requests 0 and 1"), "{}", err.message());
    }
    // Distinct devices in distinct containers stay fine.
    let r = kubelet.allocate("example.com/good", vec![vec!["example-0".into()], vec!["example-1".into()]]).await;
    assert_eq!(r.unwrap().container_responses.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_pre_start_container_is_refused() {
    let node = Node::new();
    let (kubelet, _d) = start(&node, &format!("module = \"{}\"", module("testdrv").display())).await;
    let err = kubelet.pre_start("example.com/good", vec![]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("PreStartContainer request has no device IDs"), "{}", err.message());
    kubelet.pre_start("example.com/good", vec!["example-0".into()]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_watch_streams_per_endpoint_are_capped_and_slots_come_back() {
    let node = Node::new();
    let (kubelet, _d) = start(&node, &format!("module = \"{}\"", module("testdrv").display())).await;
    let path = kubelet.endpoint_path("example.com/good").unwrap();
    let mut c = pb::device_plugin_client::DevicePluginClient::new(devhost_proto::connect_uds(&path).await.unwrap());
    // The kubelet's own stream is one of the four.
    let mut open = Vec::new();
    for _ in 0..3 {
        let mut s = c.list_and_watch(pb::Empty {}).await.unwrap().into_inner();
        assert_eq!(s.message().await.unwrap().unwrap().devices.len(), 2);
        open.push(s);
    }
    let err = c.list_and_watch(pb::Empty {}).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert!(err.message().contains("4 ListAndWatch streams are open already"), "{}", err.message());
    drop(open.pop());
    let again = tokio::time::timeout(WAIT, async {
        loop {
            match c.list_and_watch(pb::Empty {}).await {
                Ok(s) => return s,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    });
    assert!(again.await.is_ok(), "a closed stream gives its slot back");
    assert!(kubelet.is_connected("example.com/good"), "the kubelet's stream is untouched");
    good_still_allocates(&kubelet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_per_socket_are_capped_and_silent_ones_are_closed() {
    use std::io::Read;
    let node = Node::new();
    let (kubelet, d) = start(&node, &format!("module = \"{}\"", module("testdrv").display())).await;
    let path = kubelet.endpoint_path("example.com/good").unwrap();
    // The kubelet holds one of the 16 connections; clients that say nothing take the rest.
    let silent: Vec<std::os::unix::net::UnixStream> =
        (0..15).map(|_| std::os::unix::net::UnixStream::connect(&path).unwrap()).collect();
    d.wait_log("16 connections are open on the endpoint's socket; further ones wait", WAIT).await;
    let late = tokio::spawn(async move {
        let ch = devhost_proto::connect_uds(&path).await?;
        let mut c = pb::device_plugin_client::DevicePluginClient::new(ch);
        c.get_device_plugin_options(pb::Empty {}).await.map_err(|e| e.to_string())?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!late.is_finished(), "a 17th connection waits for a free slot");
    // The kubelet's connection is served meanwhile.
    good_still_allocates(&kubelet).await;
    // The silent ones are closed after 10 s; the waiting client then gets its answer.
    let answered = tokio::time::timeout(Duration::from_secs(30), late).await;
    assert!(matches!(answered, Ok(Ok(Ok(())))), "{answered:?}");
    let mut s = &silent[0];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // It gets the server's settings, then the end of the connection.
    let closed = s.read_to_end(&mut Vec::new());
    assert!(closed.is_ok(), "a silent client is disconnected: {closed:?}");
}
