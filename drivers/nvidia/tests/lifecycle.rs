//! A driver instance's whole life, many times in one process: open NVML,
//! start the health thread, stop, drop. What `devhost conformance` checks
//! with `create/destroy x100`, at the driver's level, through the real
//! nvml-wrapper path (it dlopens the library per instance and dlcloses it
//! after `nvmlShutdown`). The only test of this binary, so the process's
//! descriptors and threads are its own.

mod common;

use common::*;
use std::time::Duration;

fn open_descriptors() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .filter_map(|e| {
            let e = e.ok()?;
            let target = std::fs::read_link(e.path()).ok()?;
            Some(format!("{} -> {}", e.file_name().to_string_lossy(), target.display()))
        })
        .collect()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("read /proc/self/task").count()
}

#[test]
fn create_watch_destroy_cycles_leave_no_descriptor_or_thread_behind() {
    let gpus: Vec<GpuSpec> = (0..2).map(|i| gpu(i, &format!("0000:{:02x}:00.0", 0x18 + i), 0)).collect();
    let fx = Fixture::new(&gpus, &machine_toml("", &gpus, &[]));
    let cycle = || {
        let node = fx.open(&[]);
        node.watch_start();
        // Long enough for the health thread to block in its event wait,
        // which arms the event set's own inotify watch in the fake.
        std::thread::sleep(Duration::from_millis(20));
        drop(node);
    };
    // Warm-up: whatever a first NVML session keeps for good (the loader's
    // caches, the log capture) is not a leak.
    cycle();
    let (fds_before, threads_before) = (open_descriptors(), threads());
    for _ in 0..10 {
        cycle();
    }
    let fds_after = open_descriptors();
    assert!(
        fds_after.len() <= fds_before.len(),
        "10 cycles left {} descriptor(s) open:\nbefore: {fds_before:#?}\nafter: {fds_after:#?}",
        fds_after.len() - fds_before.len()
    );
    assert!(wait_until(Duration::from_secs(3), || threads() <= threads_before), "10 cycles left threads behind");
}
