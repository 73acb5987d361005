//! ResourceSlices published by the real `devhost` binary, serving the C example driver as a DRA
//! resource, on a real kube-apiserver and etcd (built by `tests/cluster/build`; a server that
//! cannot start fails these tests, it never skips them). Each test has a node of its own on one
//! shared API server.

use std::time::{Duration, Instant};

use crate::common::apiserver::ApiServerHarness;
use crate::common::*;
use devhost::fronts::dra::api::ApiServer;
use devhost_proto::dra_health::v1 as health;
use k8s_openapi::api::core::v1::Node as NodeObject;
use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};

const DRIVER: &str = "accel.example.com";
/// How long a change may take to reach the API server on a loaded machine.
const PUBLISHED_WITHIN: Duration = Duration::from_secs(20);

struct Setup<'a> {
    harness: &'a ApiServerHarness,
    client: kube::Client,
    node_uid: String,
}

/// The shared API server, an admin client, and a Node object `node` (the slices' owner).
async fn setup(node: &str) -> Setup<'static> {
    let harness = tokio::task::spawn_blocking(ApiServerHarness::shared).await.expect("harness thread");
    setup_on(harness, node).await
}

/// [`setup`] on `harness`.
async fn setup_on<'a>(harness: &'a ApiServerHarness, node: &str) -> Setup<'a> {
    let api = ApiServer::connect(Some(harness.kubeconfig()), Some(node)).await.expect("admin client");
    let nodes: Api<NodeObject> = Api::all(api.client.clone());
    let object = NodeObject {
        metadata: kube::api::ObjectMeta { name: Some(node.into()), ..Default::default() },
        ..Default::default()
    };
    let created = nodes.create(&PostParams::default(), &object).await.expect("create the Node");
    Setup { harness, client: api.client, node_uid: created.metadata.uid.expect("a Node UID") }
}

/// A devhost serving `count` example devices as DRA resource `example.com/accel` for `node`.
fn start_devhost(node_dir: &Node, s: &Setup<'_>, node: &str, count: usize) -> Daemon {
    start_devhost_with(node_dir, s, node, count, "", "")
}

/// `start_devhost`, with `top` (top-level manifest lines) and `tail` (more tables, at the end) added.
fn start_devhost_with(node_dir: &Node, s: &Setup<'_>, node: &str, count: usize, top: &str, tail: &str) -> Daemon {
    let manifest = node_dir.write_manifest(&format!(
        r#"{top}
kubelet_root_dir = "{root}"
kubeconfig = "{kubeconfig}"
node_name = "{node}"

[driver.cdrv]
module = "{c}"
options = {{ count = {count}, numa_nodes = 2, health_file = "{health}", model = "example-v9" }}

[[resource]]
name = "example.com/accel"
driver = "cdrv"
api = "dra"
{tail}
"#,
        root = node_dir.path().join("kubelet-root").display(),
        kubeconfig = s.harness.kubeconfig().display(),
        c = module("example_c").display(),
        health = node_dir.path().join("health").display(),
    ));
    Daemon::start(&manifest, &node_dir.kubelet_dir())
}

/// The slices of (DRIVER, node), by name.
async fn slices(client: &kube::Client, node: &str) -> Vec<ResourceSlice> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let params = ListParams::default().fields(&format!("spec.driver={DRIVER},spec.nodeName={node}"));
    let mut items = api.list(&params).await.expect("list ResourceSlices").items;
    items.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    items
}

/// The health taint's key of [`DRIVER`].
const UNHEALTHY: &str = "accel.example.com/unhealthy";

/// Every (device, taint) of `slices`.
fn tainted(slices: &[ResourceSlice]) -> Vec<(String, DeviceTaint)> {
    let devices = slices.iter().flat_map(|s| s.spec.devices.iter().flatten());
    devices.flat_map(|d| d.taints.iter().flatten().map(|t| (d.name.clone(), t.clone()))).collect()
}

fn device_names(slices: &[ResourceSlice]) -> Vec<String> {
    slices.iter().flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone())).collect()
}

/// Polls until `done` holds for the node's slices; panics with them and devhost's log if not
/// within [`PUBLISHED_WITHIN`]. Returns the slices and how long it took.
async fn wait_slices(
    client: &kube::Client,
    node: &str,
    daemon: &Daemon,
    what: &str,
    done: impl Fn(&[ResourceSlice]) -> bool,
) -> (Vec<ResourceSlice>, Duration) {
    let start = Instant::now();
    loop {
        let got = slices(client, node).await;
        if done(&got) {
            return (got, start.elapsed());
        }
        if start.elapsed() > PUBLISHED_WITHIN {
            let summary: Vec<String> = got
                .iter()
                .map(|s| {
                    format!(
                        "{} gen {} count {} devices {:?}",
                        s.metadata.name.as_deref().unwrap_or("?"),
                        s.spec.pool.generation,
                        s.spec.pool.resource_slice_count,
                        device_names(std::slice::from_ref(s))
                    )
                })
                .collect();
            panic!("{what}: not within {PUBLISHED_WITHIN:?}; slices: {summary:#?}\ndevhost log:\n{}", daemon.logs());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_carry_the_healthy_devices_with_typed_attributes_and_follow_health() {
    let node = "node-health";
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let s = setup(node).await;
    let dir = Node::new();
    let mut d = start_devhost_with(&dir, &s, node, 4, &format!("metrics_addr = \"{addr}\""), "");
    let (got, _) = wait_slices(&s.client, node, &d, "the first slice", |x| device_names(x).len() == 4).await;
    assert_eq!(got.len(), 1);
    let slice = &got[0];
    assert_eq!(slice.metadata.name.as_deref(), Some("node-health-accel.example.com-0000"));
    assert_eq!(slice.spec.driver, DRIVER);
    assert_eq!(slice.spec.node_name.as_deref(), Some(node));
    assert_eq!((slice.spec.pool.name.as_str(), slice.spec.pool.resource_slice_count), (node, 1));
    assert!(slice.spec.pool.generation >= 1);
    let owner = &slice.metadata.owner_references.as_ref().expect("an owner")[0];
    assert_eq!((owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()), ("Node", node, s.node_uid.as_str()));
    assert_eq!(owner.controller, Some(true));
    let devices = slice.spec.devices.as_ref().unwrap();
    assert_eq!(device_names(&got), ["example-0", "example-1", "example-2", "example-3"]);
    for (i, dev) in devices.iter().enumerate() {
        let attrs = dev.attributes.as_ref().expect("attributes");
        assert_eq!(attrs["model"].string.as_deref(), Some("example-v9"), "{dev:?}");
        assert_eq!(attrs["vendor"].string.as_deref(), Some("example.com"));
        assert_eq!(attrs["index"].int, Some(i as i64), "a number is published as an int");
        assert_eq!(attrs["numaNode"].int, Some(i as i64 % 2));
    }

    assert!(devices.iter().all(|d| d.taints.is_none()), "a healthy device has no taint");

    // A device turning unhealthy stays in the slice with the health taint (the C example gives
    // no reason, so no value); recovery clears it.
    std::fs::write(dir.path().join("health"), "example-1\n").unwrap();
    let (sick, took) = wait_slices(&s.client, node, &d, "example-1 tainted", |x| !tainted(x).is_empty()).await;
    eprintln!("device change to updated ResourceSlice: {} ms (unhealthy)", took.as_millis());
    assert_eq!(device_names(&sick).len(), 4, "the unhealthy device stays published");
    let taints = tainted(&sick);
    assert_eq!(taints.len(), 1, "{taints:?}");
    let (name, taint) = &taints[0];
    assert_eq!(name, "example-1");
    assert_eq!((taint.key.as_str(), taint.value.as_deref(), taint.effect.as_str()), (UNHEALTHY, None, "NoSchedule"));
    assert!(taint.time_added.is_some(), "the server stamps the taint's time");
    std::fs::write(dir.path().join("health"), "").unwrap();
    let (back, took) = wait_slices(&s.client, node, &d, "example-1 untainted", |x| tainted(x).is_empty()).await;
    eprintln!("device change to updated ResourceSlice: {} ms (healthy again)", took.as_millis());
    assert_eq!(device_names(&back).len(), 4);
    assert_eq!(back.len(), 1, "one slice throughout: updated in place");
    let log = d.logs();
    assert!(log.contains("DRA: ResourceSlices published"), "{log}");
    // What was published, for an operator's dashboard: the devices now, and every pass counted.
    let body = devhost::ops::metrics::get(addr, "/metrics", &[]).await.unwrap().body;
    let value = |series: &str| body.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next());
    assert_eq!(value("devhost_dra_published_devices{resource=\"example.com/accel\"}"), Some("4"), "{body}");
    let passes = value("devhost_dra_slice_publishes_total{resource=\"example.com/accel\",outcome=\"ok\"}");
    assert!(passes.and_then(|v| v.parse::<u32>().ok()).is_some_and(|n| n >= 3), "first, unhealthy, back: {body}");
    assert_eq!(value("devhost_dra_slice_publishes_total{resource=\"example.com/accel\",outcome=\"error\"}"), Some("0"));
    assert!(!log.contains("fields dropped or changed"), "the server kept every field sent: {log}");

    // Stopping devhost leaves the slices to the kubelet (which wipes them 30 s after the driver
    // is gone), so a restart does not make the devices flap.
    assert!(d.terminate(Duration::from_secs(20)).is_some(), "devhost stops on SIGTERM");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(device_names(&slices(&s.client, node).await).len(), 4, "slices stay after devhost stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_deleted_by_someone_are_published_again() {
    let node = "node-wiped";
    let s = setup(node).await;
    let dir = Node::new();
    let d = start_devhost(&dir, &s, node, 2);
    let (first, _) = wait_slices(&s.client, node, &d, "the first slice", |x| device_names(x).len() == 2).await;
    let old_uid = first[0].metadata.uid.clone();
    // What the kubelet does at its start: delete every slice of its node.
    s.harness.kubectl(&["delete", "resourceslices", "--field-selector", &format!("spec.nodeName={node}")]);
    let (again, took) = wait_slices(&s.client, node, &d, "republished after a wipe", |x| {
        device_names(x).len() == 2 && x[0].metadata.uid != old_uid
    })
    .await;
    eprintln!("deleted slice republished in {} ms", took.as_millis());
    assert!(took < Duration::from_secs(10), "the watch, not the 60 s resync, brought it back: {took:?}");
    // An admin deleting one slice by name.
    let api: Api<ResourceSlice> = Api::all(s.client.clone());
    let name = again[0].metadata.name.clone().unwrap();
    api.delete(&name, &DeleteParams::default()).await.expect("delete the slice");
    let uid = again[0].metadata.uid.clone();
    wait_slices(&s.client, node, &d, "republished after a delete", |x| {
        device_names(x).len() == 2 && x[0].metadata.uid != uid
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_over_128_devices_is_split_with_one_generation_and_64_once_a_device_is_tainted() {
    let node = "node-big";
    let s = setup(node).await;
    let dir = Node::new();
    let d = start_devhost(&dir, &s, node, 300);
    let consistent = |x: &[ResourceSlice], count: usize| {
        x.len() == count
            && x.iter().all(|s| s.spec.pool.resource_slice_count == count as i64)
            && x.iter().all(|s| s.spec.pool.generation == x[0].spec.pool.generation)
    };
    let (got, _) = wait_slices(&s.client, node, &d, "300 devices in 3 slices", |x| {
        consistent(x, 3) && device_names(x).len() == 300
    })
    .await;
    let sizes: Vec<usize> = got.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).collect();
    assert_eq!(sizes, [128, 128, 44]);
    let names: Vec<&str> = got.iter().map(|s| s.metadata.name.as_deref().unwrap()).collect();
    assert_eq!(
        names,
        ["node-big-accel.example.com-0000", "node-big-accel.example.com-0001", "node-big-accel.example.com-0002"]
    );
    let mut unique = device_names(&got);
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 300, "every device once");
    let generation = got[0].spec.pool.generation;

    // 60 devices unhealthy: all 300 stay, 60 tainted, and a slice with a tainted device holds at
    // most 64, so the pool is split into 5 slices at a new generation.
    let sick: String = (0..60).map(|i| format!("example-{i}\n")).collect();
    std::fs::write(dir.path().join("health"), sick).unwrap();
    let (got, took) = wait_slices(&s.client, node, &d, "300 devices in 5 slices, 60 tainted", |x| {
        consistent(x, 5) && device_names(x).len() == 300 && tainted(x).len() == 60
    })
    .await;
    eprintln!("device change to updated 5-slice pool: {} ms", took.as_millis());
    let sizes: Vec<usize> = got.iter().map(|s| s.spec.devices.as_ref().map_or(0, Vec::len)).collect();
    assert_eq!(sizes, [64, 64, 64, 64, 44]);
    let tainted_generation = got[0].spec.pool.generation;
    assert!(tainted_generation > generation, "a change across slices bumps the generation");
    assert!(
        tainted(&got)
            .iter()
            .all(|(name, t)| t.key == UNHEALTHY && name["example-".len()..].parse::<u32>().unwrap() < 60)
    );

    // Recovered: 3 slices of 128 again, the other two deleted, at a newer generation.
    std::fs::write(dir.path().join("health"), "").unwrap();
    let (got, _) = wait_slices(&s.client, node, &d, "300 devices in 3 slices again", |x| {
        consistent(x, 3) && device_names(x).len() == 300 && tainted(x).is_empty()
    })
    .await;
    assert!(got[0].spec.pool.generation > tainted_generation);
}

/// The slice publisher compares what the API server stored with what it sent; capacities are
/// written in the server's canonical form, so a stored slice equals the sent one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_stores_capacities_as_devhost_writes_them() {
    use k8s_openapi::api::resource::v1::{Device, DeviceCapacity, ResourcePool, ResourceSliceSpec};
    let s = setup("node-quantities").await;
    let sent: Vec<_> = [(81559, 2), (40960, 2), (16, 3), (1024 * 1024, 2), (0, 2)]
        .iter()
        .map(|&(n, power)| devhost::fronts::dra::slices::binary_quantity(n, power))
        .collect();
    let devices = sent
        .iter()
        .enumerate()
        .map(|(i, q)| Device {
            name: format!("d{i}"),
            capacity: Some([("memory".to_string(), DeviceCapacity { value: q.clone(), request_policy: None })].into()),
            ..Default::default()
        })
        .collect();
    let slice = ResourceSlice {
        metadata: kube::api::ObjectMeta { name: Some("quantities".into()), ..Default::default() },
        spec: ResourceSliceSpec {
            driver: "q.example.com".into(),
            node_name: Some("node-quantities".into()),
            pool: ResourcePool { name: "node-quantities".into(), generation: 1, resource_slice_count: 1 },
            devices: Some(devices),
            ..Default::default()
        },
    };
    let api: Api<ResourceSlice> = Api::all(s.client.clone());
    let stored = api.create(&PostParams::default(), &slice).await.expect("create the slice");
    let got: Vec<_> =
        stored.spec.devices.unwrap().into_iter().map(|d| d.capacity.unwrap()["memory"].value.clone()).collect();
    assert_eq!(got, sent);
    assert_eq!(stored.spec.pool, slice.spec.pool);
}

/// The NVIDIA driver (on the workspace's fake NVML) as a DRA resource: what the cluster tests'
/// CEL selectors rely on (`model`, `numaNode`, capacity `memory`) and the standard PCI attribute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvidia_gpus_are_published_with_model_numa_memory_and_pci_bus_id() {
    let node = "node-gpu";
    let s = setup(node).await;
    let dir = Node::new();
    let root = dir.path();
    let uuid = "GPU-0e5b9c2a-1d3f-4a6b-8c7d-000000000001";
    let bus = "0000:3b:00.0";
    let machine = format!(
        "control = \"control\"\n[[gpu]]\nuuid = \"{uuid}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory_mib = 81559\n\
             pci_bus_id = \"0000{}\"\nminor = 0\n",
        bus.to_uppercase()
    );
    let lib = fake_nvml_node(root, &machine, "pci0000:3a", &[(bus, 1)]);
    let manifest = dir.write_manifest(&format!(
        r#"kubelet_root_dir = "{root}/kubelet-root"
kubeconfig = "{kubeconfig}"
node_name = "{node}"

[driver.nvidia]
module = "{module}"
[driver.nvidia.options]
nvml_lib = "{lib}/libnvidia-ml.so.1"
sysfs_root = "{root}/sys"
devfs_root = "{root}/dev"

[[resource]]
name = "nvidia.com/gpu"
driver = "nvidia"
match = {{ kind = "gpu" }}
api = "dra"
"#,
        root = root.display(),
        kubeconfig = s.harness.kubeconfig().display(),
        module = module("nvidia").display(),
        lib = lib.display(),
    ));
    let d = Daemon::start(&manifest, &dir.kubelet_dir());
    let api: Api<ResourceSlice> = Api::all(s.client.clone());
    let params = ListParams::default().fields(&format!("spec.driver=gpu.nvidia.com,spec.nodeName={node}"));
    let start = Instant::now();
    let slice = loop {
        let items = api.list(&params).await.expect("list").items;
        if let Some(slice) = items.into_iter().find(|s| s.spec.devices.as_ref().is_some_and(|d| !d.is_empty())) {
            break slice;
        }
        assert!(start.elapsed() < PUBLISHED_WITHIN, "no GPU slice; devhost log:\n{}", d.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(slice.metadata.name.as_deref(), Some("node-gpu-gpu.nvidia.com-0000"));
    let device = &slice.spec.devices.as_ref().unwrap()[0];
    assert_eq!(device.name, devhost::fronts::dra::prepare::dra_device_name(uuid));
    let attrs = device.attributes.as_ref().unwrap();
    assert_eq!(attrs["model"].string.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(attrs["numaNode"].int, Some(1));
    assert_eq!(attrs["uuid"].string.as_deref(), Some(uuid));
    assert_eq!(attrs["resource.kubernetes.io/pciBusID"].string.as_deref(), Some(bus));
    assert_eq!(attrs["pciAddress"].string.as_deref(), Some(bus));
    assert!(!attrs.contains_key("memory"), "memory is a capacity");
    let capacity = device.capacity.as_ref().unwrap();
    assert_eq!(capacity["memory"].value.0, "81559Mi");
}

/// A DRA resource beside a driver whose create hangs for 5 s: its slices are
/// published without waiting for that create (as its device-plugin twin is
/// served, `daemon/startup.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_slow_to_create_does_not_hold_back_the_slices_of_another() {
    let node = "node-slow-neighbour";
    let s = setup(node).await;
    let dir = Node::new();
    let slow = format!(
        "[driver.slow]\nmodule = \"{}\"\noptions = {{ count = 1, hang_in = \"create\", hang_ms = 5000 }}\n\
         [[resource]]\nname = \"example.com/slow\"\ndriver = \"slow\"\n",
        module("testdrv").display()
    );
    let started = Instant::now();
    let d = start_devhost_with(&dir, &s, node, 2, "", &slow);
    let (got, _) = wait_slices(&s.client, node, &d, "both devices published", |sl| device_names(sl).len() == 2).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "the slices came {took:?} after start, after the other driver's 5 s create; {got:?}\nlog:\n{}",
        d.logs()
    );
}

/// A DRA resource of the Rust test driver, whose health file gives reasons, tainted NoExecute.
fn start_reasons(node_dir: &Node, s: &Setup<'_>, node: &str) -> Daemon {
    let manifest = node_dir.write_manifest(&format!(
        r#"kubelet_root_dir = "{root}"
kubeconfig = "{kubeconfig}"
node_name = "{node}"

[driver.rdrv]
module = "{r}"
poll_interval = "100ms"
options = {{ count = 3, prefix = "r", health_file = "{health}" }}

[[resource]]
name = "example.com/accel"
driver = "rdrv"
api = "dra"
dra_taint_effect = "NoExecute"
"#,
        root = node_dir.path().join("kubelet-root").display(),
        kubeconfig = s.harness.kubeconfig().display(),
        r = module("testdrv").display(),
        health = node_dir.path().join("health").display(),
    ));
    Daemon::start(&manifest, &node_dir.kubelet_dir())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taint_carries_the_drivers_reason_and_its_effect_and_keeps_its_time() {
    let node = "node-reasons";
    let s = setup(node).await;
    let dir = Node::new();
    let health = dir.path().join("health");
    std::fs::write(&health, "r-1 temperature 97 C (limit 95)\n").unwrap();
    let d = start_reasons(&dir, &s, node);
    let (got, _) = wait_slices(&s.client, node, &d, "r-1 tainted", |x| tainted(x).len() == 1).await;
    assert_eq!(device_names(&got), ["r-0", "r-1", "r-2"]);
    let (name, first) = tainted(&got).remove(0);
    assert_eq!(name, "r-1");
    assert_eq!(first.key, UNHEALTHY);
    assert_eq!(first.value.as_deref(), Some("temperature-97-C-limit-95"), "the reason as a label value");
    assert_eq!(first.effect, "NoExecute", "dra_taint_effect");
    // Another device turning unhealthy rewrites the slice: r-1's taint keeps its time (a
    // NoExecute toleration's seconds count from it).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    std::fs::write(&health, "r-1 temperature 97 C (limit 95)\nr-2\n").unwrap();
    let (got, _) = wait_slices(&s.client, node, &d, "r-2 tainted too", |x| tainted(x).len() == 2).await;
    let taints = tainted(&got);
    assert_eq!(taints[0], (name, first), "r-1's taint is unchanged, its timeAdded included");
    assert_eq!((taints[1].0.as_str(), taints[1].1.value.as_deref()), ("r-2", None), "no reason, no value");
    let log = d.logs();
    assert!(!log.contains("fields dropped or changed") && !log.contains("dropped the device taints"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_device_taints_on_the_server_an_unhealthy_device_leaves_its_slice() {
    let harness = tokio::task::spawn_blocking(|| {
        ApiServerHarness::start_with(&["--feature-gates=DRADeviceTaints=false,DRADeviceTaintRules=false"])
    })
    .await
    .expect("harness thread");
    let node = "node-no-taints";
    let s = setup_on(&harness, node).await;
    let dir = Node::new();
    std::fs::write(dir.path().join("health"), "example-2\n").unwrap();
    let mut d = start_devhost(&dir, &s, node, 3);
    let (got, _) = wait_slices(&s.client, node, &d, "the slice without example-2", |x| {
        device_names(x) == ["example-0", "example-1"]
    })
    .await;
    assert!(tainted(&got).is_empty());
    let log = d.wait_log("dropped the device taints", WAIT).await;
    assert_eq!(log.matches("dropped the device taints").count(), 1, "said once: {log}");
    assert!(!log.contains("fields dropped or changed"), "taints are not reported again as a dropped field: {log}");
    // Recovery adds the device back, as before taints.
    std::fs::write(dir.path().join("health"), "").unwrap();
    wait_slices(&s.client, node, &d, "example-2 back", |x| device_names(x).len() == 3).await;
    assert!(d.terminate(Duration::from_secs(20)).is_some());
}

/// The next report of `stream` whose devices `done` accepts, as (device, health, message).
async fn next_report<S>(
    stream: &mut S,
    what: &str,
    done: impl Fn(&[(String, i32, String)]) -> bool,
) -> Vec<(String, i32, String)>
where
    S: tokio_stream::Stream<Item = Result<health::NodeWatchResourcesResponse, tonic::Status>> + Unpin,
{
    use tokio_stream::StreamExt;
    loop {
        let report = tokio::time::timeout(WAIT, stream.next()).await;
        let report = report.unwrap_or_else(|_| panic!("{what}: no report within {WAIT:?}"));
        let report = report.expect("the stream goes on").expect("a report");
        let devices: Vec<(String, i32, String)> = report
            .devices
            .iter()
            .map(|d| {
                let id = d.device.as_ref().expect("a device identifier");
                assert_eq!(id.pool_name, "node-health-stream", "the pool is the node");
                assert_eq!(d.health_check_timeout_seconds, 30);
                (id.device_name.clone(), d.health, d.message.clone())
            })
            .collect();
        if done(&devices) {
            return devices;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_service_streams_every_device_with_its_reason_at_each_change() {
    use devhost_proto::dra_health::v1alpha1;
    let node = "node-health-stream";
    let s = setup(node).await;
    let dir = Node::new();
    let file = dir.path().join("health");
    std::fs::write(&file, "r-1 temperature 97 C (limit 95)\n").unwrap();
    let d = start_reasons(&dir, &s, node);
    let socket = dir.path().join("kubelet-root/plugins").join(DRIVER).join("dra.sock");
    eventually_with("the plugin socket", WAIT, || socket.exists(), || d.logs()).await;
    let channel = devhost_proto::connect_uds(&socket).await.expect("the plugin socket");
    let mut client = health::dra_resource_health_client::DraResourceHealthClient::new(channel.clone());
    let mut stream = client.node_watch_resources(health::NodeWatchResourcesRequest {}).await.unwrap().into_inner();
    let (healthy, unhealthy) = (health::HealthStatus::Healthy as i32, health::HealthStatus::Unhealthy as i32);
    let first = next_report(&mut stream, "the first report", |r| r.len() == 3).await;
    assert_eq!(
        first,
        [
            ("r-0".to_string(), healthy, String::new()),
            ("r-1".to_string(), unhealthy, "temperature 97 C (limit 95)".to_string()),
            ("r-2".to_string(), healthy, String::new()),
        ]
    );
    // A change is reported as it happens, not at the next 10 s report.
    let start = Instant::now();
    std::fs::write(&file, "").unwrap();
    let all = next_report(&mut stream, "the recovery", |r| r.iter().all(|(_, h, _)| *h == healthy)).await;
    assert!(start.elapsed() < Duration::from_secs(5), "reported {:?} after the change", start.elapsed());
    assert_eq!(all.len(), 3);
    // v1alpha1, for 1.34 to 1.36 kubelets: the same report.
    let mut alpha = v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel);
    let mut stream = alpha.node_watch_resources(v1alpha1::NodeWatchResourcesRequest {}).await.unwrap().into_inner();
    let report =
        tokio::time::timeout(WAIT, tokio_stream::StreamExt::next(&mut stream)).await.unwrap().unwrap().unwrap();
    assert_eq!(report.devices.len(), 3);
    assert!(report.devices.iter().all(|d| d.health == v1alpha1::HealthStatus::Healthy as i32));
}
