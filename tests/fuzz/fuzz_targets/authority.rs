//! The HTTP/2 `:authority` mender in front of the DRA registration socket (fronts/dra/authority.rs)
//! against any local client. Half the inputs are raw bytes after the connection preface (no
//! panic, no runaway memory: libFuzzer's -rss_limit_mb). The other half are well-framed sequences
//! of frames (header lists HPACK-encoded with one connection's table, padded, prioritised and cut
//! into CONTINUATION frames at arbitrary points, between other frames): the server must receive
//! valid HTTP/2 framing, every other frame byte for byte, and every header list unchanged but
//! for an `:authority` that is not a valid authority, which becomes `localhost`.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use loona_hpack::{Decoder, Encoder};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Counts the bytes held, to check that one connection's memory stays bounded by its input
/// whatever the header blocks say (HPACK can name one table entry thousands of times).
struct Counting;
static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let held = HELD.fetch_add(layout.size(), Relaxed) + layout.size();
        PEAK.fetch_max(held, Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size(), Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// What the mender accepts (fronts/dra/authority.rs: MAX_HEADER_BLOCK, MAX_HEADER_LIST).
const MAX_BLOCK: usize = 64 * 1024;
const MAX_LIST: usize = 64 * 1024;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const NAMES: [&[u8]; 8] =
    [b":method", b":scheme", b":path", b":authority", b"content-type", b"te", b"grpc-timeout", b"x-b"];

#[derive(Debug, Arbitrary)]
enum Op {
    Headers {
        headers: Vec<(u8, Vec<u8>)>,
        stream: u8,
        end_stream: bool,
        padding: Option<u8>,
        priority: bool,
        cuts: Vec<u8>,
    },
    Other {
        kind: u8,
        flags: u8,
        stream: u8,
        payload: Vec<u8>,
    },
}

type Header = (Vec<u8>, Vec<u8>);

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len();
    out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Appends `op`'s frames to `input`; returns what the server must see for it.
fn send(op: &Op, encoder: &mut Encoder, input: &mut Vec<u8>) -> Expected {
    match op {
        Op::Headers { headers, stream, end_stream, padding, priority, cuts } => {
            let list: Vec<Header> =
                headers.iter().map(|(n, v)| (NAMES[usize::from(*n) % NAMES.len()].to_vec(), v.clone())).collect();
            let block = encoder.encode(list.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
            let mut pieces = Vec::new();
            let mut rest = block.as_slice();
            for &cut in cuts {
                let (a, b) = rest.split_at(usize::from(cut).min(rest.len()));
                pieces.push(a);
                rest = b;
            }
            pieces.push(rest);
            let stream = u32::from(*stream);
            let mut first = Vec::new();
            let mut flags = if *end_stream { 0x1 } else { 0 };
            if let Some(pad) = padding {
                flags |= 0x8;
                first.push(*pad);
            }
            if *priority {
                flags |= 0x20;
                first.extend_from_slice(&[0, 0, 0, 0, 16]);
            }
            first.extend_from_slice(pieces[0]);
            first.resize(first.len() + usize::from(padding.unwrap_or(0)), 0);
            let last = pieces.len() - 1;
            frame(input, 0x1, flags | if last == 0 { 0x4 } else { 0 }, stream, &first);
            for (i, piece) in pieces.iter().enumerate().skip(1) {
                frame(input, 0x9, if i == last { 0x4 } else { 0 }, stream, piece);
            }
            let size: usize = list.iter().map(|(n, v)| n.len() + v.len() + 32).sum();
            let refused = first.len() > MAX_BLOCK || block.len() > MAX_BLOCK || size > MAX_LIST;
            let mended = list
                .into_iter()
                .map(|(n, v)| match n.as_slice() == b":authority" && !is_authority(&v) {
                    true => (n, b"localhost".to_vec()),
                    false => (n, v),
                })
                .collect();
            Expected::Headers { list: mended, stream, end_stream: *end_stream, refused }
        }
        Op::Other { kind, flags, stream, payload } => {
            let kind = if matches!(kind, 0x1 | 0x9) { 0x0 } else { *kind };
            let mut bytes = Vec::new();
            frame(&mut bytes, kind, *flags, u32::from(*stream), payload);
            input.extend_from_slice(&bytes);
            Expected::Frame(bytes)
        }
    }
}

enum Expected {
    /// `refused`: over the mender's limits, so the connection ends here.
    Headers {
        list: Vec<Header>,
        stream: u32,
        end_stream: bool,
        refused: bool,
    },
    Frame(Vec<u8>),
}

fn is_authority(value: &[u8]) -> bool {
    !value.is_empty() && http::uri::Authority::try_from(value).is_ok()
}

/// The next frame of `out` at `at`: (kind, flags, stream, payload), moving `at` past it.
fn next<'a>(out: &'a [u8], at: &mut usize) -> (u8, u8, u32, &'a [u8]) {
    let head = out.get(*at..*at + 9).expect("a whole frame header");
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
    let payload = out.get(*at + 9..*at + 9 + len).expect("a whole frame payload");
    *at += 9 + len;
    (head[3], head[4], stream, payload)
}

fn check(out: &[u8], expected: &[Expected]) {
    let at = check_prefix(out, expected);
    assert_eq!(at, out.len(), "bytes after the last frame");
}

/// Checks that `out` starts with what `expected` says; returns where that ends.
fn check_prefix(out: &[u8], expected: &[Expected]) -> usize {
    assert_eq!(&out[..PREFACE.len()], PREFACE);
    let mut at = PREFACE.len();
    let mut decoder = Decoder::new();
    for want in expected {
        match want {
            Expected::Frame(bytes) => {
                let start = at;
                next(out, &mut at);
                assert_eq!(&out[start..at], bytes.as_slice(), "a frame other than HEADERS was changed");
            }
            Expected::Headers { list, stream, end_stream, .. } => {
                let (kind, flags, sid, payload) = next(out, &mut at);
                assert_eq!((kind, sid, flags & 0x1 != 0), (0x1, *stream, *end_stream), "HEADERS frame");
                assert_eq!(flags & 0x28, 0, "no padding or priority left to the server");
                let mut block = payload.to_vec();
                let mut done = flags & 0x4 != 0;
                while !done {
                    let (kind, flags, sid, payload) = next(out, &mut at);
                    assert_eq!((kind, sid), (0x9, *stream), "a CONTINUATION of the same stream");
                    block.extend_from_slice(payload);
                    done = flags & 0x4 != 0;
                }
                let got = decoder.decode(&block).expect("the server can decode the mended block");
                assert_eq!(&got, list, "the header list changed beyond :authority");
            }
        }
    }
    at
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("a runtime"))
}

fuzz_target!(|data: &[u8]| {
    let rt = runtime();
    let before = HELD.load(Relaxed);
    PEAK.store(before, Relaxed);
    mend(rt, data);
    let peak = PEAK.load(Relaxed) - before;
    assert!(peak <= (4 << 20) + 16 * data.len(), "{peak} bytes held for a {}-byte input", data.len());
});

fn mend(rt: &tokio::runtime::Runtime, data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut out = Vec::new();
    if mode & 1 == 1 {
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(rest);
        let _ = rt.block_on(devhost::fronts::dra::mend_requests(&input, &mut out));
        return;
    }
    let Ok(ops) = Vec::<Op>::arbitrary_take_rest(Unstructured::new(rest)) else { return };
    let mut encoder = Encoder::new();
    let mut input = PREFACE.to_vec();
    let mut expected: Vec<Expected> = ops.iter().map(|op| send(op, &mut encoder, &mut input)).collect();
    let result = rt.block_on(devhost::fronts::dra::mend_requests(&input, &mut out));
    let refused = expected.iter().position(|e| matches!(e, Expected::Headers { refused: true, .. }));
    match refused {
        Some(at) => {
            result.expect_err("a header block over the limits ends the connection");
            expected.truncate(at);
            check_prefix(&out, &expected);
        }
        None => {
            result.expect("a well-framed connection is mended without error");
            check(&out, &expected);
        }
    }
}
