//! Criterion micro-benchmarks of the host's hot paths: composing Allocate
//! edits, the default preferred allocation, and encoding a ListAndWatch list.
//! Run with `cargo bench -p devhost-bench`; the IDs are read back by the main
//! bench (`src/micro.rs`), so keep them in step with `micro::BENCHES`.

use criterion::{Criterion, criterion_group, criterion_main};
use devhost::driver::device::{Device, DeviceNode, Edits, compose};
use devhost_bench::prefer::Instance;
use devhost_proto::v1beta1 as pb;
use prost::Message;
use std::collections::BTreeMap;
use std::hint::black_box;

/// A device as the C example reports it: one device node and one env var.
fn device(i: usize) -> Device {
    let id = format!("example-{i}");
    Device {
        id: id.clone(),
        healthy: true,
        health_reason: None,
        numa_node: Some((i % 2) as i64),
        attributes: BTreeMap::from([
            ("index".to_string(), i.to_string()),
            ("model".to_string(), "example-v1".to_string()),
        ]),
        edits: Edits {
            device_nodes: vec![DeviceNode {
                host_path: "/dev/null".into(),
                container_path: format!("/dev/example{i}"),
                permissions: "rw".into(),
            }],
            envs: vec![("EXAMPLE_VISIBLE_DEVICES".into(), id)],
            ..Edits::default()
        },
        links: vec![(format!("example-{}", i ^ 1), 10)],
    }
}

fn list(n: usize) -> pb::ListAndWatchResponse {
    pb::ListAndWatchResponse {
        devices: (0..n)
            .map(|i| pb::Device {
                id: format!("gpu-{i:05}"),
                health: devhost_proto::HEALTHY.into(),
                topology: Some(pb::TopologyInfo { nodes: vec![pb::NumaNode { id: (i % 2) as i64 }] }),
            })
            .collect(),
    }
}

fn hot_paths(c: &mut Criterion) {
    let devices: Vec<Device> = (0..64).map(device).collect();
    c.bench_function("compose_64_devices", |b| b.iter(|| compose(black_box(&devices).iter())));

    let small = Instance::grouped(16, 4);
    c.bench_function("choose_4_of_16_exhaustive", |b| b.iter(|| black_box(&small).choose()));
    let large = Instance::grouped(64, 8);
    c.bench_function("choose_8_of_64_greedy", |b| b.iter(|| black_box(&large).choose()));

    let msg = list(1000);
    let mut buf = Vec::with_capacity(msg.encoded_len());
    c.bench_function("encode_list_1000_devices", |b| {
        b.iter(|| {
            buf.clear();
            black_box(&msg).encode(&mut buf).map(|()| buf.len())
        })
    });
    c.bench_function("encoded_len_list_1000_devices", |b| b.iter(|| black_box(&msg).encoded_len()));
}

criterion_group!(benches, hot_paths);
criterion_main!(benches);
