//! The kubelet's plugin watcher dials a registration socket by its bare path with grpc-go and no
//! authority override, so every request it sends carries the socket path as its HTTP/2
//! `:authority`. h2, the HTTP/2 layer under tonic, refuses such a request as malformed (stream
//! reset, PROTOCOL_ERROR), and the kubelet never learns the driver (its log: `failed to get plugin
//! info using RPC GetInfo … PROTOCOL_ERROR`). The Device Plugin and DRA clients of the kubelet set
//! `localhost` themselves; the plugin watcher does not.
//!
//! [`mend`] sits between an accepted connection and the tonic server: frames from the client
//! pass through unchanged, except header blocks, which are decoded (HPACK, with the connection's
//! own table), given `localhost` for an `:authority` that is not a valid URI authority, and
//! encoded again for the server. Nothing else is touched; the server's answers pass through as
//! they are. A client that breaks HTTP/2 (a bad frame or header block, a block over
//! [`MAX_HEADER_BLOCK`]) loses its connection, as h2 would have closed it.

use std::io;

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};

/// The connection preface every HTTP/2 client sends first.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame h2 accepts unless told otherwise (SETTINGS_MAX_FRAME_SIZE's default); the
/// mended blocks are cut to it.
const MAX_FRAME: usize = 16_384;
/// Largest header block accepted from a client (a gRPC request's is well under 1 KiB).
pub const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Largest decoded header list accepted, counted as HTTP/2 counts SETTINGS_MAX_HEADER_LIST_SIZE
/// (name, value and 32 bytes per field). HPACK lets a 64 KiB block name one 4 KiB table entry
/// tens of thousands of times, a quarter of a gigabyte decoded; hyper under tonic refuses
/// anything over 16 KiB anyway, so this only stops the mender from building such a list.
pub const MAX_HEADER_LIST: usize = 64 * 1024;
/// The dynamic table size h2 advertises (SETTINGS_HEADER_TABLE_SIZE's default), which bounds the
/// client's table and so the decoder's.
const TABLE_SIZE: usize = 4096;
/// What an unusable `:authority` becomes.
const LOCALHOST: &[u8] = b"localhost";
/// Bytes buffered between the mender and the server, each way.
const PIPE: usize = 64 * 1024;

/// Serves `client` through a mender: returns the server's end of an in-memory pipe whose other
/// end is pumped to and from `client` by a task of its own, which ends with either side.
pub fn mend<S>(client: S) -> DuplexStream
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (server_end, ours) = tokio::io::duplex(PIPE);
    tokio::spawn(async move {
        let (mut from_client, mut to_client) = tokio::io::split(client);
        let (mut from_server, mut to_server) = tokio::io::split(ours);
        let up = async {
            let result = pump_requests(&mut from_client, &mut to_server).await;
            let _ = to_server.shutdown().await;
            result
        };
        let down = async {
            let result = tokio::io::copy(&mut from_server, &mut to_client).await.map(|_| ());
            let _ = to_client.shutdown().await;
            result
        };
        let (up, _) = tokio::join!(up, down);
        if let Err(e) = up {
            tracing::debug!("DRA registration connection closed: {e}");
        }
    });
    server_end
}

fn broken(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// Client → server: the preface, then frame by frame, header blocks mended.
async fn pump_requests<R, W>(from: &mut R, to: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    from.read_exact(&mut preface).await?;
    if &preface != PREFACE {
        return Err(broken("not an HTTP/2 connection preface"));
    }
    to.write_all(&preface).await?;
    let mut decoder = Decoder::new();
    decoder.set_max_allowed_table_size(TABLE_SIZE);
    let mut encoder = Encoder::new();
    loop {
        let mut head = [0u8; 9];
        match from.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let (len, kind, flags, stream) = parse_head(&head);
        if kind != HEADERS {
            // Passed through as it is, without holding more than a copy buffer of it.
            to.write_all(&head).await?;
            tokio::io::copy(&mut (&mut *from).take(len as u64), to).await?;
            continue;
        }
        let block = read_header_block(from, len, flags, stream).await?;
        let mut headers = decode_block(&mut decoder, &block)?;
        for (name, value) in &mut headers {
            if name.as_slice() == b":authority" && !is_authority(value) {
                *value = LOCALHOST.to_vec();
            }
        }
        let mended = encoder.encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        write_header_block(to, &mended, flags & END_STREAM, stream).await?;
    }
}

/// The client → server half of [`mend`] over a whole byte string (the client's bytes, preface
/// first), for the fuzz target tests/fuzz/fuzz_targets/authority.rs: what reaches the server is
/// appended to `out`.
#[doc(hidden)]
pub async fn mend_requests(input: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
    pump_requests(&mut &input[..], out).await
}

/// The header list of `block`, refused past [`MAX_HEADER_LIST`] without holding more than that.
fn decode_block(decoder: &mut Decoder<'_>, block: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut headers = Vec::new();
    let mut size = 0usize;
    decoder
        .decode_with_cb(block, |name, value| {
            // The decoder still runs to the end of the block: its table must stay in step.
            size = size.saturating_add(name.len() + value.len() + 32);
            if size <= MAX_HEADER_LIST {
                headers.push((name.into_owned(), value.into_owned()));
            }
        })
        .map_err(|e| broken(format!("bad header block: {e:?}")))?;
    if size > MAX_HEADER_LIST {
        return Err(broken(format!("a header list over {MAX_HEADER_LIST} bytes decoded")));
    }
    Ok(headers)
}

fn parse_head(head: &[u8; 9]) -> (usize, u8, u8, u32) {
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    (len, head[3], head[4], stream)
}

/// Whether h2 would take `value` as an authority.
fn is_authority(value: &[u8]) -> bool {
    !value.is_empty() && tonic::codegen::http::uri::Authority::try_from(value).is_ok()
}

/// A HEADERS frame of `len` bytes (head already read) and its CONTINUATION frames: the header
/// block fragment without padding and priority fields.
async fn read_header_block<R>(from: &mut R, len: usize, flags: u8, stream: u32) -> io::Result<Vec<u8>>
where
    R: AsyncRead + Unpin,
{
    if len > MAX_HEADER_BLOCK {
        return Err(broken(format!("a {len}-byte HEADERS frame")));
    }
    let mut payload = vec![0u8; len];
    from.read_exact(&mut payload).await?;
    let mut start = 0;
    let mut end = payload.len();
    if flags & PADDED != 0 {
        let pad = usize::from(*payload.first().ok_or_else(|| broken("PADDED HEADERS frame without its length"))?);
        start = 1;
        end = end.checked_sub(pad).filter(|&e| e >= start).ok_or_else(|| broken("padding longer than the frame"))?;
    }
    if flags & PRIORITY != 0 {
        start += 5;
        if start > end {
            return Err(broken("PRIORITY HEADERS frame too short"));
        }
    }
    let mut block = payload[start..end].to_vec();
    let mut done = flags & END_HEADERS != 0;
    while !done {
        let mut head = [0u8; 9];
        from.read_exact(&mut head).await?;
        let (len, kind, flags, sid) = parse_head(&head);
        if kind != CONTINUATION || sid != stream {
            return Err(broken("a header block interrupted by another frame"));
        }
        if block.len() + len > MAX_HEADER_BLOCK {
            return Err(broken(format!("a header block over {MAX_HEADER_BLOCK} bytes")));
        }
        let at = block.len();
        block.resize(at + len, 0);
        from.read_exact(&mut block[at..]).await?;
        done = flags & END_HEADERS != 0;
    }
    Ok(block)
}

/// Writes `block` as one HEADERS frame (keeping `end_stream`) and CONTINUATION frames as needed.
async fn write_header_block<W>(to: &mut W, block: &[u8], end_stream: u8, stream: u32) -> io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    // An empty block is still one frame.
    let chunks: Vec<&[u8]> = if block.is_empty() { vec![block] } else { block.chunks(MAX_FRAME).collect() };
    for (i, chunk) in chunks.iter().enumerate() {
        let (kind, mut flags) = if i == 0 { (HEADERS, end_stream) } else { (CONTINUATION, 0) };
        if i + 1 == chunks.len() {
            flags |= END_HEADERS;
        }
        let len = chunk.len();
        let mut frame = Vec::with_capacity(9 + len);
        frame.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        frame.extend_from_slice(&stream.to_be_bytes());
        frame.extend_from_slice(chunk);
        to.write_all(&frame).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_path_is_not_an_authority_but_a_host_is() {
        assert!(!is_authority(b"/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock"));
        assert!(!is_authority(b""));
        assert!(is_authority(b"localhost"));
        assert!(is_authority(b"[::]:50051"));
    }

    #[tokio::test]
    async fn padded_prioritized_and_continued_blocks_are_joined_and_mended() {
        let mut enc = Encoder::new();
        let block = enc.encode([(&b":authority"[..], &b"/run/x.sock"[..]), (&b":path"[..], &b"/a"[..])]);
        let (a, b) = block.split_at(3);
        let mut input = Vec::new();
        input.extend_from_slice(PREFACE);
        // HEADERS, PADDED|PRIORITY|END_STREAM, 2 bytes of padding, then a CONTINUATION.
        let len = 1 + 5 + a.len() + 2;
        input.extend_from_slice(&[0, 0, len as u8, HEADERS, PADDED | PRIORITY | END_STREAM, 0, 0, 0, 1]);
        input.push(2);
        input.extend_from_slice(&[0, 0, 0, 0, 16]);
        input.extend_from_slice(a);
        input.extend_from_slice(&[0, 0]);
        input.extend_from_slice(&[0, 0, b.len() as u8, CONTINUATION, END_HEADERS, 0, 0, 0, 1]);
        input.extend_from_slice(b);
        let mut out = Vec::new();
        pump_requests(&mut input.as_slice(), &mut out).await.unwrap();
        assert_eq!(&out[..24], PREFACE);
        let head: [u8; 9] = out[24..33].try_into().unwrap();
        let (len, kind, flags, stream) = parse_head(&head);
        assert_eq!((kind, flags, stream), (HEADERS, END_STREAM | END_HEADERS, 1));
        let headers = Decoder::new().decode(&out[33..33 + len]).unwrap();
        assert_eq!(headers[0], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(headers[1], (b":path".to_vec(), b"/a".to_vec()));
    }

    #[tokio::test]
    async fn an_oversized_or_interrupted_block_closes_the_connection() {
        let mut big = PREFACE.to_vec();
        big.extend_from_slice(&[0x01, 0, 1, HEADERS, END_HEADERS, 0, 0, 0, 1]);
        big.resize(big.len() + 65_537, 0);
        assert!(pump_requests(&mut big.as_slice(), &mut Vec::new()).await.is_err());
        let mut cut = PREFACE.to_vec();
        cut.extend_from_slice(&[0, 0, 0, HEADERS, 0, 0, 0, 0, 1]);
        cut.extend_from_slice(&[0, 0, 0, 0x0, 0, 0, 0, 0, 1]);
        let error = pump_requests(&mut cut.as_slice(), &mut Vec::new()).await.unwrap_err();
        assert!(error.to_string().contains("interrupted"), "{error}");
    }

    #[tokio::test]
    async fn a_block_that_decodes_past_the_header_list_limit_closes_the_connection() {
        // One 4,000-byte value put in the dynamic table, then named again 100 times by its index
        // (one byte each): 4 KiB of block, 400 KB of header list.
        // The encoder adds a header of a new name to its table (literal with incremental indexing).
        let mut block = Encoder::new().encode([(&b"x-big"[..], &[b'v'; 4000][..])]);
        assert_eq!(block[0], 0x40);
        block.extend_from_slice(&[0x80 | 62; 100]);
        let mut input = PREFACE.to_vec();
        let len = block.len();
        input.extend_from_slice(&[0, (len >> 8) as u8, len as u8, HEADERS, END_HEADERS, 0, 0, 0, 1]);
        input.extend_from_slice(&block);
        let error = pump_requests(&mut input.as_slice(), &mut Vec::new()).await.unwrap_err();
        assert!(error.to_string().contains("header list over"), "{error}");
    }

    /// What the kubelet's plugin watcher sends: GetInfo with the socket path as `:authority`,
    /// framed by hand (no Rust client can send such a request), to a real tonic registration
    /// server on a real unix socket; `mended` puts the mender in front. Returns the answer's
    /// plugin name, or the error code of the stream reset.
    async fn get_info(mended: bool) -> Result<String, u32> {
        use devhost_proto::pluginregistration::registration_server::RegistrationServer;
        use prost::Message;
        use tokio_stream::StreamExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.example.com-reg.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let service = crate::fronts::dra::registration::Registration::new(
            "gpu.example.com",
            &dir.path().join("dra.sock"),
            Default::default(),
        );
        let server = tonic::transport::Server::builder().add_service(RegistrationServer::new(service));
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let task = if mended {
            tokio::spawn(server.serve_with_incoming(incoming.map(|c| c.map(mend))))
        } else {
            tokio::spawn(server.serve_with_incoming(incoming))
        };
        let mut conn = tokio::net::UnixStream::connect(&path).await.unwrap();
        let socket = path.display().to_string();
        let block = Encoder::new().encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", socket.as_bytes()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]);
        let mut out = PREFACE.to_vec();
        out.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&[0, 0, block.len() as u8, HEADERS, END_HEADERS, 0, 0, 0, 1]);
        out.extend_from_slice(&block);
        out.extend_from_slice(&[0, 0, 5, 0x0, END_STREAM, 0, 0, 0, 1, 0, 0, 0, 0, 0]);
        conn.write_all(&out).await.unwrap();
        let mut data = Vec::new();
        let answer = loop {
            let mut head = [0u8; 9];
            conn.read_exact(&mut head).await.unwrap();
            let (len, kind, flags, stream) = parse_head(&head);
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await.unwrap();
            match (kind, stream) {
                (0x3, 1) => break Err(u32::from_be_bytes(payload[..4].try_into().unwrap())),
                (0x0, 1) => data.extend_from_slice(&payload),
                (HEADERS, 1) if flags & END_STREAM != 0 => {
                    let info = devhost_proto::pluginregistration::PluginInfo::decode(&data[5..]).unwrap();
                    break Ok(info.name);
                }
                _ => {}
            }
        };
        task.abort();
        answer
    }

    #[tokio::test]
    async fn the_plugin_watchers_get_info_is_refused_by_h2_and_answered_once_mended() {
        const PROTOCOL_ERROR: u32 = 1;
        assert_eq!(get_info(false).await, Err(PROTOCOL_ERROR), "h2 refuses a socket path as :authority");
        assert_eq!(get_info(true).await.as_deref(), Ok("gpu.example.com"));
    }
}
