//! What kubelet input must pass before tonic decodes it, so that the memory an endpoint spends on
//! requests is bounded by construction, whatever a client sends: connections per socket, HTTP/2
//! streams and flow-control windows per connection, requests in flight per endpoint (and, for
//! large ones, in the whole process), ListAndWatch streams per endpoint (each sends its own copy
//! of the device list), the 4 MiB message size the kubelet works with, and, for a large message,
//! a count of its device IDs read from the wire ([`census`](super::census)), so that no message
//! decodes into far more memory than it has bytes.

use super::census::{Call, admissible, census};
use crate::engine::registry::{Resource, Services};
use http_body_util::BodyExt;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit, mpsc};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Bytes, http};
use tonic::server::NamedService;
use tonic::transport::server::Connected;
use tower::ServiceExt;

/// The largest reply: ListAndWatch of 100,000 devices with long IDs stays under it. Replies are
/// built from the registry's own data; the kubelet refuses any over 4 MiB on its side.
pub const MAX_REPLY: usize = 64 << 20;
/// Connections open on one endpoint's socket at once (the kubelet uses one); later ones wait in
/// the socket's backlog until one closes.
pub const MAX_CONNECTIONS: usize = 16;
/// HTTP/2 streams open on one connection at once (the kubelet's ListAndWatch plus a call or two).
pub const MAX_STREAMS: u32 = 8;
/// HTTP/2 flow-control windows: how much request data a client may send before the endpoint
/// reads it. The connection window bounds what one connection can park in memory; it is the sum
/// of the stream windows, so that streams waiting for their turn never use up the window the
/// stream being read needs.
pub const STREAM_WINDOW: u32 = 32 << 10;
pub const CONNECTION_WINDOW: u32 = MAX_STREAMS * STREAM_WINDOW;
/// Request headers per stream (hyper's default, stated here because it is part of the bound).
pub const MAX_HEADERS: u32 = 16 << 10;
/// Allocate, GetPreferredAllocation and PreStartContainer requests of one endpoint being read,
/// decoded or answered at once; more wait their turn.
pub const MAX_IN_FLIGHT: usize = 2;
/// A message larger than this is "large": it needs one of [`MAX_LARGE`] slots of the whole
/// process, and its device IDs are counted before it is decoded.
pub const LARGE: usize = 64 << 10;
/// Large messages read, decoded or answered at once in the whole process.
pub const MAX_LARGE: usize = 2;
static LARGE_SLOTS: Semaphore = Semaphore::const_new(MAX_LARGE);
/// How long a client may take to send a whole request (the kubelet needs milliseconds).
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);
/// ListAndWatch streams open on one endpoint at once (the kubelet keeps one): each sends its
/// own copy of the device list, which for a large resource is megabytes.
pub const MAX_WATCHERS: usize = 4;
/// The endpoint's gRPC service behind the limits of this module.
#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    resource: Arc<Resource>,
    services: Arc<Services>,
    in_flight: Arc<Semaphore>,
    watchers: Arc<Semaphore>,
}

impl<S> Guard<S> {
    pub fn new(inner: S, resource: Arc<Resource>, services: Arc<Services>) -> Guard<S> {
        Guard {
            inner,
            resource,
            services,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            watchers: Arc::new(Semaphore::new(MAX_WATCHERS)),
        }
    }
}

impl<S: NamedService> NamedService for Guard<S> {
    const NAME: &'static str = S::NAME;
}

type Reply = http::Response<Body>;

impl<S> tower::Service<http::Request<Body>> for Guard<S>
where
    S: tower::Service<http::Request<Body>, Response = Reply, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    type Response = Reply;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Reply, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let started = Instant::now();
            let call = Call::of(req.uri().path());
            let name = this.resource.config.name.as_str();
            // `Empty` requests are at most 1 KiB: they need no turn, so that a slow driver call
            // never holds up ListAndWatch or the kubelet's GetDevicePluginOptions.
            let turn = if matches!(call, Call::Watch | Call::Empty) {
                None
            } else {
                // Never closed; the error branch only keeps this free of panics.
                let Ok(turn) = this.in_flight.clone().acquire_owned().await else {
                    return Ok(Status::unavailable(format!("resource {name}: endpoint is stopping")).into_http());
                };
                Some(turn)
            };
            let (parts, body) = req.into_parts();
            let read = tokio::time::timeout(BODY_DEADLINE, this.read(call, body)).await.unwrap_or_else(|_| {
                Err((
                    Status::deadline_exceeded(format!(
                        "resource {name}: the {} request did not arrive within {BODY_DEADLINE:?}",
                        call.name()
                    )),
                    0,
                ))
            });
            let (body, large) = match read {
                Ok(read) => read,
                Err((status, ids)) => {
                    if call == Call::Allocate {
                        this.services.metrics.allocation(name, false, started.elapsed());
                        this.resource.status.refused_unread(ids, status.message().to_string(), started.elapsed());
                    }
                    return Ok(status.into_http());
                }
            };
            let req = http::Request::from_parts(parts, body);
            if call == Call::Watch {
                // The stream lives long: it holds a watcher slot for as long as its reply is
                // being sent.
                let Ok(slot) = this.watchers.clone().try_acquire_owned() else {
                    return Ok(Status::resource_exhausted(format!(
                        "resource {name}: {MAX_WATCHERS} ListAndWatch streams are open already (the kubelet keeps one)"
                    ))
                    .into_http());
                };
                let reply = this.inner.oneshot(req).await;
                return reply.map(|r| r.map(|body| Body::new(Holding { body, _slot: slot })));
            }
            let reply = this.inner.oneshot(req).await;
            drop((turn, large));
            reply
        })
    }
}

impl<S> Guard<S> {
    /// Reads the one message of a unary request (under [`MAX_MESSAGE`](super::census::MAX_MESSAGE), counted when large) and
    /// gives it back as a body for tonic to decode, with the large-message slot it holds. A
    /// refusal comes with the number of device IDs counted (0 when not counted).
    async fn read(&self, call: Call, body: Body) -> Result<(Body, Option<SemaphorePermit<'static>>), (Status, usize)> {
        let mut counted = 0;
        self.read_counted(call, body, &mut counted).await.map_err(|status| (status, counted))
    }

    async fn read_counted(
        &self,
        call: Call,
        mut body: Body,
        counted: &mut usize,
    ) -> Result<(Body, Option<SemaphorePermit<'static>>), Status> {
        let name = self.resource.config.name.as_str();
        let invalid = |what: String| Status::invalid_argument(format!("resource {name}: {what}"));
        let mut buf: Vec<u8> = Vec::new();
        let mut want = None;
        let mut large = None;
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else { continue };
            if want.is_some_and(|w| buf.len() + data.len() > w) {
                return Err(invalid(format!("{} request holds more than one message", call.name())));
            }
            buf.extend_from_slice(&data);
            if want.is_none() && buf.len() >= 5 {
                if buf[0] != 0 {
                    return Err(Status::unimplemented(format!(
                        "resource {name}: compressed messages are not accepted"
                    )));
                }
                let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
                if len > call.limit() {
                    return Err(Status::resource_exhausted(format!(
                        "resource {name}: {} message of {len} bytes is larger than the limit of {} bytes",
                        call.name(),
                        call.limit()
                    )));
                }
                if len > LARGE {
                    large = Some(LARGE_SLOTS.acquire().await.map_err(|_| Status::unavailable("shutting down"))?);
                }
                if buf.len() > 5 + len {
                    return Err(invalid(format!("{} request holds more than one message", call.name())));
                }
                buf.reserve_exact(5 + len - buf.len());
                want = Some(5 + len);
            }
        }
        if want.is_some_and(|w| buf.len() < w) {
            return Err(invalid(format!("{} request ended inside its message", call.name())));
        }
        if large.is_some() {
            let c = census(call, &buf[5..]).map_err(invalid)?;
            *counted = c.ids;
            admissible(call, c, self.resource.snapshot().advertised.len()).map_err(invalid)?;
        }
        Ok((Body::new(http_body_util::Full::new(Bytes::from(buf))), large))
    }
}

/// A reply body that holds a slot until it is sent or dropped.
struct Holding {
    body: Body,
    _slot: OwnedSemaphorePermit,
}

impl hyper::body::Body for Holding {
    type Data = Bytes;
    type Error = Status;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Status>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// A connection that holds one of its endpoint's [`MAX_CONNECTIONS`] slots while open.
pub struct Connection {
    io: UnixStream,
    _slot: OwnedSemaphorePermit,
    /// Until the client's first bytes: when it must have sent them.
    silent: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// A connection that has sent nothing (not even the HTTP/2 preface) within this is closed, so
/// that forgotten or idle clients do not keep the endpoint's connection slots.
pub const FIRST_BYTES_DEADLINE: Duration = Duration::from_secs(10);

impl Connected for Connection {
    type ConnectInfo = <UnixStream as Connected>::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Some(silent) = self.silent.as_mut() {
            match read {
                Poll::Ready(Ok(())) if buf.filled().len() > before => self.silent = None,
                Poll::Pending if silent.as_mut().poll(cx).is_ready() => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client sent nothing within {FIRST_BYTES_DEADLINE:?}"),
                    )));
                }
                _ => {}
            }
        }
        read
    }
}

impl AsyncWrite for Connection {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The connections accepted on `listener`, at most [`MAX_CONNECTIONS`] open at once. The accept
/// task ends (closing the listener) when the server stops taking connections.
pub fn incoming(
    listener: UnixListener,
    resource: String,
) -> tokio_stream::wrappers::ReceiverStream<io::Result<Connection>> {
    let (tx, rx) = mpsc::channel(1);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        let mut said = false;
        loop {
            if slots.available_permits() == 0 && !said {
                tracing::warn!(
                    resource,
                    "{MAX_CONNECTIONS} connections are open on the endpoint's socket; further ones wait until one closes"
                );
                said = true;
            }
            let slot = tokio::select! {
                slot = slots.clone().acquire_owned() => match slot { Ok(s) => s, Err(_) => return },
                _ = tx.closed() => return,
            };
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = tx.closed() => return,
            };
            match accepted {
                Ok((io, _)) => {
                    if tx
                        .send(Ok(Connection {
                            io,
                            _slot: slot,
                            silent: Some(Box::pin(tokio::time::sleep(FIRST_BYTES_DEADLINE))),
                        }))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Err(e) => {
                    // Out of file descriptors, most likely: pause rather than spin.
                    tracing::debug!(resource, "accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
