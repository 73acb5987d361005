use devhost_bench::latency::{allocate, sequential};
use devhost_bench::node::{self, Artifacts, Node, Proc};
use kubelet_emu::Kubelet;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let art = Artifacts::locate()?;
    let art = Artifacts { dir: art.dir.parent().unwrap().to_path_buf(), repo: art.repo };
    for (count, drv, lg) in [(10000usize, "benchdrv", 0), (10000, "benchdrv", 8)] {
        let node = Node::new()?;
        let kubelet = Kubelet::start(&node.kubelet_dir())?;
        let prefix = if drv == "benchdrv" { "b" } else { "example" };
        let m = node.write_manifest("d.toml", &format!("[driver.b]\nmodule = \"{}\"\noptions = {{ count = {count}, link_group = {lg} }}\n[[resource]]\nname = \"x.com/r\"\ndriver = \"b\"\n", art.module(drv).display()))?;
        let d = Proc::devhost(&art, &m, &node.kubelet_dir())?;
        node::wait_all_registered(&kubelet, &["x.com/r".to_string()], 1, Some(&d)).await?;
        kubelet.wait_devices("x.com/r", node::WAIT, |x| x.len() == count).await?;
        let c = node::plugin_client(&kubelet, "x.com/r").await?;
        let p = prefix.to_string();
        sequential(&c, 200, |cl, k| allocate(cl, vec![format!("{p}-{}", k % 8)])).await?;
        let s = sequential(&c, 2000, |cl, k| allocate(cl, vec![format!("{p}-{}", k % 8)])).await?.summary().unwrap();
        println!("before streams {drv} count={count} lg={lg}: p50 {:?} p99 {:?}", s.p50, s.p99);
        for _ in 0..10 {
            let mut cc = c.clone();
            let mut st = cc.list_and_watch(devhost_proto::v1beta1::Empty {}).await?.into_inner();
            st.message().await?;
        }
        sequential(&c, 200, |cl, k| allocate(cl, vec![format!("{p}-{}", k % 8)])).await?;
        let s = sequential(&c, 2000, |cl, k| allocate(cl, vec![format!("{p}-{}", k % 8)])).await?.summary().unwrap();
        println!("after streams {drv} count={count} lg={lg}: p50 {:?} p99 {:?}", s.p50, s.p99);
    }
    Ok(())
}
