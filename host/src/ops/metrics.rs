//! Metrics and probes on `metrics_addr`: `/metrics` in the Prometheus text format (OpenMetrics
//! when the scraper asks for it) through the Prometheus project's `prometheus-client`, `/healthz`
//! (the process and its async runtime answer), `/readyz` (every enabled resource is registered
//! with the kubelet) and `/status` (the typed document of [`crate::engine::status::model`]). The
//! server is a small hyper 1 HTTP/1.1 loop; what each path answers is decided by [`respond`],
//! which needs no socket.

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::engine::status::model::StatusDocument;
/// Upper bounds of the Allocate latency buckets, in seconds: from a composed answer (well under
/// a millisecond) to a driver hook near the default 10 s call deadline.
use crate::engine::telemetry::Metrics;

const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT_TYPE: &str = "text/plain; charset=utf-8";
const JSON_TYPE: &str = "application/json";
/// A client that has not sent its request headers by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

pub type Check<T> = Arc<dyn Fn() -> T + Send + Sync>;

/// What the probes ask the rest of the host. The closures run on the async runtime, so they
/// must be quick and never block (take a lock, read a flag).
#[derive(Clone)]
pub struct Probes {
    /// `/healthz`: `Err(why)` when the host is alive but broken. The handler running at all
    /// already proves the runtime answers.
    pub live: Check<Result<(), String>>,
    /// `/readyz`: `Err(resources not registered)` until every enabled resource is registered.
    pub ready: Check<Result<(), Vec<String>>>,
    /// `/status`: the document of [`crate::engine::status::model`].
    pub status: Check<StatusDocument>,
}

impl Probes {
    /// Probes with an always-passing liveness check.
    pub fn new(
        ready: impl Fn() -> Result<(), Vec<String>> + Send + Sync + 'static,
        status: impl Fn() -> StatusDocument + Send + Sync + 'static,
    ) -> Probes {
        Probes { live: Arc::new(|| Ok(())), ready: Arc::new(ready), status: Arc::new(status) }
    }
}

/// An HTTP answer before it meets the wire.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

fn answer(status: u16, content_type: &'static str, body: impl Into<String>) -> Answer {
    Answer { status, content_type, body: body.into() }
}

/// What a `GET` (or `HEAD`) of `path` answers. `accept` is the request's Accept header: a
/// scraper that names `application/openmetrics-text` gets OpenMetrics.
pub fn respond(path: &str, accept: Option<&str>, metrics: &Metrics, probes: &Probes) -> Answer {
    match path {
        "/metrics" => {
            let openmetrics = accept.is_some_and(|a| a.contains("application/openmetrics-text"));
            let content_type =
                if openmetrics { OPENMETRICS_TYPE } else { prometheus_client::encoding::prometheus_text::CONTENT_TYPE };
            match metrics.encode(openmetrics) {
                Ok(text) => answer(200, content_type, text),
                Err(e) => answer(500, TEXT_TYPE, format!("cannot encode metrics: {e}\n")),
            }
        }
        "/healthz" => match (probes.live)() {
            Ok(()) => answer(200, TEXT_TYPE, "ok\n"),
            Err(why) => answer(503, TEXT_TYPE, format!("unhealthy: {why}\n")),
        },
        "/readyz" => match (probes.ready)() {
            Ok(()) => answer(200, TEXT_TYPE, "ready\n"),
            Err(missing) => {
                answer(503, TEXT_TYPE, format!("not ready: not registered with the kubelet: {}\n", missing.join(", ")))
            }
        },
        "/status" => match serde_json::to_string_pretty(&(probes.status)()) {
            Ok(mut text) => {
                text.push('\n');
                answer(200, JSON_TYPE, text)
            }
            Err(e) => answer(500, TEXT_TYPE, format!("cannot encode the status: {e}\n")),
        },
        "/" => answer(200, TEXT_TYPE, "devhost: /metrics /healthz /readyz /status\n"),
        _ => answer(404, TEXT_TYPE, format!("no such path {path:?}; try /metrics /healthz /readyz /status\n")),
    }
}

fn to_response(req: &Request<Incoming>, metrics: &Metrics, probes: &Probes) -> Response<Full<Bytes>> {
    let a = if req.method() == Method::GET || req.method() == Method::HEAD {
        let accept = req.headers().get(header::ACCEPT).and_then(|v| v.to_str().ok());
        respond(req.uri().path(), accept, metrics, probes)
    } else {
        answer(405, TEXT_TYPE, "only GET and HEAD are served\n")
    };
    let mut resp = Response::new(Full::new(Bytes::from(a.body)));
    *resp.status_mut() = StatusCode::from_u16(a.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(a.content_type));
    if a.status == 405 {
        resp.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
    }
    resp
}

/// Binds the metrics address; a separate step so that a taken port fails the start, naming it.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("metrics_addr {addr}: cannot listen: {e}")))
}

/// Serves the four paths until `stop` turns true (or its sender goes away); then open
/// connections are closed.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, probes: Probes, mut stop: watch::Receiver<bool>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let (metrics, probes) = (metrics.clone(), probes.clone());
                    conns.spawn(async move {
                        let svc = hyper::service::service_fn(move |req| {
                            let resp = to_response(&req, &metrics, &probes);
                            async move { Ok::<_, std::convert::Infallible>(resp) }
                        });
                        let conn = hyper::server::conn::http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(HEADER_TIMEOUT)
                            .serve_connection(TokioIo::new(stream), svc);
                        if let Err(e) = conn.await {
                            tracing::debug!("metrics connection ended: {e}");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("metrics endpoint cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            // The guard `wait_for` returns must not live across the select's other awaits.
            () = async { drop(stop.wait_for(|s| *s).await) } => break,
        }
    }
    conns.abort_all();
}

/// Where to reach a server bound to `bind`: an unspecified address (`0.0.0.0`, `::`) becomes
/// the loopback of its family.
pub fn connect_addr(bind: SocketAddr) -> SocketAddr {
    match bind.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bind.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), bind.port()),
        _ => bind,
    }
}

/// A plain HTTP/1.1 reply.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// Header names in lower case.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

/// A minimal HTTP/1.1 GET with `Connection: close` (used by the tests to scrape the daemon).
/// Gives up after 5 s.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> std::io::Result<Reply> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        let mut request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        for (k, v) in headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        request.push_str("\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        parse_reply(&String::from_utf8_lossy(&raw))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange).await.map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::TimedOut, format!("GET http://{addr}{path}: no answer in 5 s"))
    })?
}

fn parse_reply(raw: &str) -> std::io::Result<Reply> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed HTTP reply");
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = head.split("\r\n");
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Reply { status, headers, body: body.to_string() })
}

#[cfg(test)]
mod tests;
