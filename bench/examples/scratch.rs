use devhost::instance::Instance;
use devhost::loader;
use devhost_bench::stats::{Samples, fmt_dur};
use std::time::{Duration, Instant};

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let so = std::path::Path::new("/work/main/target/release/libdevhost_example_c.so");
        let module = loader::load(so)?;
        let inst = Instance::create("c", module, &[("count".into(), "8".into())], Duration::from_secs(10)).await?;
        // pure hop: std thread + mpsc + oneshot, no work
        let (tx, rx) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        std::thread::spawn(move || { while let Ok(j) = rx.recv() { j() } });
        let mut a = Samples::default(); let mut h = Samples::default(); let mut ht = Samples::default(); let mut sb = Samples::default();
        for round in 0..10 {
            for _ in 0..2000 {
                let t = Instant::now();
                inst.allocate(vec!["example-1".into()]).await?;
                if round > 0 { a.push(t.elapsed()); }
                let t = Instant::now();
                let (otx, orx) = tokio::sync::oneshot::channel();
                tx.send(Box::new(move || { let _ = otx.send(()); })).ok();
                orx.await?;
                if round > 0 { h.push(t.elapsed()); }
                let t = Instant::now();
                let (otx, orx) = tokio::sync::oneshot::channel();
                tx.send(Box::new(move || { let _ = otx.send(()); })).ok();
                tokio::time::timeout(Duration::from_secs(10), orx).await??;
                if round > 0 { ht.push(t.elapsed()); }
                let t = Instant::now();
                tokio::task::spawn_blocking(|| ()).await?;
                if round > 0 { sb.push(t.elapsed()); }
            }
        }
        for (n, s) in [("Instance::allocate", a), ("hop mpsc+oneshot", h), ("hop + timeout", ht), ("spawn_blocking", sb)] {
            let s = s.summary().unwrap();
            println!("{n}: p50 {} p99 {}", fmt_dur(s.p50), fmt_dur(s.p99));
        }
        anyhow::Ok(())
    })
}
