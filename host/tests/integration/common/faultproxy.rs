//! A TCP proxy between devhost and the test API server that plays the network's faults: it
//! passes bytes both ways, adds a delay to each chunk a client sends, or goes silent (a
//! partition: connections stay open, nothing more is forwarded on them, ever). TLS passes
//! through untouched, so the server's certificate and the kubeconfig stay valid: only the port
//! in the kubeconfig changes (see [`FaultProxy::kubeconfig`]). It counts the connections open
//! at once, and keeps the most.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward both ways.
    Pass,
    /// Forward, holding each chunk a client sends for this long first.
    Delay(Duration),
    /// Forward nothing more on any connection, open or new, and never close them: every
    /// connection open while silent stays dead after the proxy passes again.
    Silent,
}

struct Shared {
    open: AtomicU64,
    most_open: AtomicU64,
}

/// A running proxy to one upstream address.
pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`, in [`Mode::Pass`].
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy listener");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, mode_rx) = watch::channel(Mode::Pass);
        let shared = Arc::new(Shared { open: AtomicU64::new(0), most_open: AtomicU64::new(0) });
        let counts = shared.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let open = counts.open.fetch_add(1, Ordering::Relaxed) + 1;
                counts.most_open.fetch_max(open, Ordering::Relaxed);
                let (counts, mode) = (counts.clone(), mode_rx.clone());
                tokio::spawn(async move {
                    serve(client, upstream, mode).await;
                    counts.open.fetch_sub(1, Ordering::Relaxed);
                });
            }
        });
        FaultProxy { addr, mode, shared, task }
    }

    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// The most connections that were open at once.
    pub fn most_open(&self) -> u64 {
        self.shared.most_open.load(Ordering::Relaxed)
    }

    /// A copy of `kubeconfig` (in `dir`) whose server is this proxy (same host, the proxy's port).
    pub fn kubeconfig(&self, kubeconfig: &Path, upstream: SocketAddr, dir: &Path) -> PathBuf {
        let text = std::fs::read_to_string(kubeconfig).expect("read the kubeconfig");
        let from = format!("https://{upstream}");
        assert!(text.contains(&from), "{} names no server {from}", kubeconfig.display());
        let path = dir.join("kubeconfig-via-proxy");
        std::fs::write(&path, text.replace(&from, &format!("https://{}", self.addr))).expect("write the kubeconfig");
        path
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One client connection: upstream dialled at once; a refused upstream closes the client.
async fn serve(client: TcpStream, upstream: SocketAddr, mode: watch::Receiver<Mode>) {
    if *mode.borrow() == Mode::Silent {
        return hold(client).await;
    }
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // Either way going silent makes the connection dead for good, as a partition does.
    let dead = watch::channel(false);
    let up = pump(cr, sw, mode.clone(), true, dead.0.clone(), dead.1.clone());
    let down = pump(sr, cw, mode, false, dead.0, dead.1);
    // Either side closing ends the connection (HTTP over TLS does not half-close), so a dead
    // connection's client going away closes the upstream side too.
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// Copies `from` to `to` while the mode allows. Once silent, reads and drops everything until
/// `from` closes (so the peer sees an open, mute connection).
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    mut mode: watch::Receiver<Mode>,
    delayed: bool,
    dead_tx: watch::Sender<bool>,
    dead: watch::Receiver<bool>,
) where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => break, Ok(n) => n },
            () = silence(&mut mode) => {
                dead_tx.send_replace(true);
                continue_silent(&mut from, &mut buf).await;
                break;
            }
        };
        let now = *mode.borrow();
        if now == Mode::Silent || *dead.borrow() {
            dead_tx.send_replace(true);
            continue_silent(&mut from, &mut buf).await;
            break;
        }
        if let (true, Mode::Delay(d)) = (delayed, now) {
            tokio::time::sleep(d).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// Returns once the proxy is silent.
async fn silence(mode: &mut watch::Receiver<Mode>) {
    let _ = mode.wait_for(|m| *m == Mode::Silent).await;
}

async fn continue_silent<R: tokio::io::AsyncRead + Unpin>(from: &mut R, buf: &mut [u8]) {
    while let Ok(n) = from.read(buf).await {
        if n == 0 {
            break;
        }
    }
}

/// A connection accepted while silent: nothing is ever sent to it.
async fn hold(mut client: TcpStream) {
    let mut buf = vec![0u8; 16 * 1024];
    continue_silent(&mut client, &mut buf).await;
}
