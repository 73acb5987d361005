//! `devhost run`: a [`Daemon`] until SIGTERM or SIGINT, reloaded on SIGHUP and whenever the
//! manifest file changes and then stays the same for [`MANIFEST_SETTLE`].

use crate::engine::registry::Mode;
use crate::ops::commands::{Flags, load_manifest};
use crate::ops::daemon::{Daemon, StartError};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tokio::time::Instant;

/// How long an edited manifest must stay unchanged before it is applied.
pub const MANIFEST_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

/// Runs the daemon for the manifest at `config`.
pub async fn run(config: &Path, kubelet_dir: Option<&Path>, flags: Flags) -> ExitCode {
    // Handlers first: a SIGTERM during start-up still removes our sockets.
    let Some(mut signals) = Signals::install() else { return ExitCode::FAILURE };
    // Watched before it is read: resources are served while the start goes
    // on, and an edit made meanwhile must not be missed.
    let mut manifest_file = ManifestFile::watch(config);
    let Some(manifest) = load_manifest(config, kubelet_dir, flags) else { return ExitCode::from(2) };
    let daemon = match Daemon::start(manifest, Mode::Serve).await {
        Ok(d) => d,
        Err(StartError::Locked(e)) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
        Err(StartError::Metrics(e)) => {
            eprintln!("devhost: {e}");
            return ExitCode::FAILURE;
        }
    };
    while let Some(why) = manifest_file.next_reload(&mut signals).await {
        tracing::info!("{why}: reloading {}", config.display());
        match load_manifest(config, kubelet_dir, flags) {
            Some(next) => {
                daemon.reload(&next).await;
            }
            None => tracing::error!("new manifest rejected; still serving the previous one"),
        }
    }
    daemon.shutdown().await;
    ExitCode::SUCCESS
}

/// The manifest file as `run` follows it. A ConfigMap update replaces the file (through a
/// symlink swap): its folder is watched, and a reload is due when the text really changed and
/// then stayed the same for [`MANIFEST_SETTLE`] (a file written in pieces is never applied
/// half-written). SIGHUP applies at once: the operator asked.
struct ManifestFile {
    path: PathBuf,
    edits: tokio::sync::mpsc::Receiver<()>,
    /// The text last applied (or read at start).
    applied: String,
    /// While an edit settles: when it may be applied, and the text then seen.
    settling: Option<(Instant, String)>,
}

impl ManifestFile {
    fn watch(config: &Path) -> ManifestFile {
        let edits = watch_manifest(config);
        let applied = std::fs::read_to_string(config).unwrap_or_default();
        ManifestFile { path: config.to_path_buf(), edits, applied, settling: None }
    }

    fn read(&self) -> String {
        std::fs::read_to_string(&self.path).unwrap_or_default()
    }

    /// Waits until a reload is due and says why; `None` on SIGTERM or SIGINT.
    async fn next_reload(&mut self, signals: &mut Signals) -> Option<&'static str> {
        let why = loop {
            let settling_until = self.settling.as_ref().map(|(at, _)| *at);
            let settled = async {
                match settling_until {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                signal = signals.next() => match signal {
                    Signal::Reload => break "SIGHUP",
                    Signal::Stop(name) => {
                        tracing::info!("{name}: removing our sockets and exiting");
                        return None;
                    }
                },
                Some(()) = self.edits.recv() => {
                    while self.edits.try_recv().is_ok() {}
                    tracing::debug!("the manifest file changed; applying it once unchanged for {MANIFEST_SETTLE:?}");
                    self.settling = Some((Instant::now() + MANIFEST_SETTLE, self.read()));
                }
                () = settled => {
                    let seen = self.settling.take().map(|(_, t)| t).unwrap_or_default();
                    let text = self.read();
                    if text != seen {
                        // Changed without an event we saw: settle again.
                        self.settling = Some((Instant::now() + MANIFEST_SETTLE, text));
                    } else if text != self.applied {
                        break "the manifest file changed";
                    }
                }
            }
        };
        self.settling = None;
        self.applied = self.read();
        Some(why)
    }
}

/// Notifies on any change in the manifest's folder that may concern it
/// (the file itself, or the `..data` link a ConfigMap volume swaps). The
/// events are read on the runtime, by a task that ends with the receiver.
fn watch_manifest(config: &Path) -> tokio::sync::mpsc::Receiver<()> {
    use inotify::WatchMask;
    use tokio_stream::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let name = config.file_name().map(|n| n.to_os_string());
    let dir = config.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    // Written, replaced, renamed, removed or touched: not reads.
    let mask = WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::MOVE
        | WatchMask::MODIFY
        | WatchMask::CLOSE_WRITE
        | WatchMask::ATTRIB
        | WatchMask::ONLYDIR;
    let mut events =
        match crate::fs_events::stream().and_then(|events| events.watches().add(&dir, mask).map(|_| events)) {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "cannot watch the manifest's folder ({e}); reload with SIGHUP");
                return rx;
            }
        };
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), "cannot read the manifest folder's events ({e}); reload with SIGHUP");
                    return;
                }
            };
            let relevant = event
                .name
                .as_deref()
                .is_some_and(|f| Some(f) == name.as_deref() || f.to_string_lossy().starts_with("..data"))
                || event.mask.contains(inotify::EventMask::Q_OVERFLOW);
            if relevant && matches!(tx.try_send(()), Err(tokio::sync::mpsc::error::TrySendError::Closed(_))) {
                return;
            }
        }
    });
    rx
}

enum Signal {
    Reload,
    Stop(&'static str),
}

/// SIGTERM, SIGINT (stop) and SIGHUP (reload).
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Option<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt()), signal(SignalKind::hangup())) {
            (Ok(term), Ok(int), Ok(hup)) => Some(Signals { term, int, hup }),
            _ => {
                tracing::error!("cannot install signal handlers");
                None
            }
        }
    }

    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::Stop("SIGTERM"),
            _ = self.int.recv() => Signal::Stop("SIGINT"),
            _ = self.hup.recv() => Signal::Reload,
        }
    }
}

/// Resolves on SIGTERM or SIGINT (SIGHUP is ignored): how `sim --keep-running` ends.
pub async fn wait_for_stop() {
    match Signals::install() {
        Some(mut s) => while !matches!(s.next().await, Signal::Stop(_)) {},
        None => std::future::pending().await,
    }
}
