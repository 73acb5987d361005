//! File-system events without a thread of their own: an inotify instance
//! whose file descriptor the tokio runtime's reactor polls, for the two
//! folders devhost watches (the manifest's and the kubelet's device-plugins
//! folder). Each user has its own instance, so their watches never interact.

/// Room for the events of one read: each is 16 bytes and a name of at most
/// 256 (NAME_MAX and its terminator).
const EVENT_BUFFER: usize = 4096;

/// An inotify instance read on the runtime; add watches with `watches()`.
pub type Events = inotify::EventStream<Vec<u8>>;

/// Opens an inotify instance whose events the current runtime reads (call
/// it inside the runtime).
pub fn stream() -> std::io::Result<Events> {
    inotify::Inotify::init()?.into_event_stream(vec![0; EVENT_BUFFER])
}
