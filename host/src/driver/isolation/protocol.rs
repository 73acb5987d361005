//! The private wire format between the host and a driver's worker process.
//! A frame is a little-endian `u32` length, then a tag byte, a `u32` call
//! ID and the body: integers in little-endian, strings and lists prefixed
//! with a `u32` count. Both ends are the same binary (the worker is the
//! host's own executable), so there is no schema evolution to plan for; the
//! worker's first frame still carries a version so a mismatched
//! `set_worker_program` fails loudly instead of misreading frames.

use crate::driver::callbacks::CallState;
use crate::driver::device::{Device, DeviceNode, Edits, Mount};
use crate::driver::invoke::Hook;
use crate::driver::loader::ModuleInfo;
use std::collections::BTreeMap;
use std::io::{self, Read};

/// Bumped whenever a frame's layout or meaning changes.
pub const VERSION: u32 = 4;
/// The call ID of the scan a worker runs by itself on a change notice: the
/// host's own requests count from 1.
pub const NOTICE_ID: u32 = 0;
/// The largest frame either side accepts (a scan of 100k devices fits).
pub const MAX_FRAME: usize = 256 << 20;

/// Host → worker: one driver call, or the order to stop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Create {
        options: Vec<(String, String)>,
    },
    WatchStart,
    Scan,
    Allocate {
        ids: Vec<String>,
        /// The DRA claim's parameters (ABI 1.3 `claim_parameters`); `None` for a container.
        parameters: Option<String>,
    },
    Preferred {
        available: Vec<String>,
        must: Vec<String>,
        size: u32,
    },
    PreStart {
        ids: Vec<String>,
    },
    Release {
        ids: Vec<String>,
    },
    /// watch_stop and destroy, then exit.
    Shutdown,
}

impl Request {
    /// The hook call this request makes; `None` for create and shutdown, which are not hooks.
    pub fn hook(&self) -> Option<Hook<'_>> {
        Some(match self {
            Request::Scan => Hook::Scan,
            Request::WatchStart => Hook::WatchStart,
            Request::Allocate { ids, parameters } => Hook::Allocate(ids, parameters.as_deref()),
            Request::Preferred { available, must, size } => Hook::Preferred { available, must, size: *size },
            Request::PreStart { ids } => Hook::PreStart(ids),
            Request::Release { ids } => Hook::Release(ids),
            Request::Create { .. } | Request::Shutdown => return None,
        })
    }

    /// The call's name in the ABI and in messages.
    pub fn name(&self) -> &'static str {
        match (self, self.hook()) {
            (_, Some(hook)) => hook.name(),
            (Request::Create { .. }, None) => "create",
            (_, None) => "destroy",
        }
    }
}

/// Worker → host.
pub enum Message {
    /// First frame: the module loaded and this is what it declared.
    Hello { version: u32, info: ModuleInfo },
    /// First frame instead of `Hello`: the module cannot be loaded (the loader's message).
    LoadFailed(String),
    /// The answer to the request with this ID.
    Reply { id: u32, status: u32, state: CallState },
    /// A driver log line (`devhost_log_level`).
    Log { level: u32, message: String },
    /// The driver called `devices_changed`. The worker is scanning now, on
    /// its driver thread, and sends the result as the reply to
    /// [`NOTICE_ID`]: the host needs no scan request of its own.
    Changed,
}

/// A frame that does not decode: the peer is not our worker, or is broken.
#[derive(Debug, thiserror::Error)]
#[error("malformed frame: {0}")]
pub struct Malformed(String);

mod tag {
    pub const CREATE: u8 = 1;
    pub const WATCH_START: u8 = 2;
    pub const SCAN: u8 = 3;
    pub const ALLOCATE: u8 = 4;
    pub const PREFERRED: u8 = 5;
    pub const PRE_START: u8 = 6;
    pub const RELEASE: u8 = 7;
    pub const SHUTDOWN: u8 = 8;
    pub const HELLO: u8 = 32;
    pub const LOAD_FAILED: u8 = 33;
    pub const REPLY: u8 = 34;
    pub const LOG: u8 = 35;
    pub const CHANGED: u8 = 36;
}

/// Builds one frame, length prefix included.
struct Enc(Vec<u8>);

impl Enc {
    fn new(tag: u8, id: u32) -> Enc {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&[0; 4]);
        buf.push(tag);
        buf.extend_from_slice(&id.to_le_bytes());
        Enc(buf)
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn count(&mut self, n: usize) {
        // Lists and strings come from one call's state, far below 4 GiB.
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    fn str(&mut self, s: &str) {
        self.count(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => {
                self.u8(1);
                self.str(s);
            }
            None => self.u8(0),
        }
    }
    fn strs(&mut self, v: &[String]) {
        self.count(v.len());
        v.iter().for_each(|s| self.str(s));
    }
    fn pairs<'a>(&mut self, n: usize, v: impl Iterator<Item = (&'a String, &'a String)>) {
        self.count(n);
        for (k, val) in v {
            self.str(k);
            self.str(val);
        }
    }
    fn edits(&mut self, e: &Edits) {
        self.count(e.device_nodes.len());
        for n in &e.device_nodes {
            self.str(&n.host_path);
            self.str(&n.container_path);
            self.str(&n.permissions);
        }
        self.count(e.mounts.len());
        for m in &e.mounts {
            self.str(&m.host_path);
            self.str(&m.container_path);
            self.u8(u8::from(m.read_only));
        }
        self.pairs(e.envs.len(), e.envs.iter().map(|(k, v)| (k, v)));
        self.pairs(e.annotations.len(), e.annotations.iter().map(|(k, v)| (k, v)));
        self.strs(&e.cdi_devices);
    }
    fn device(&mut self, d: &Device) {
        self.str(&d.id);
        self.u8(u8::from(d.healthy));
        self.opt_str(d.health_reason.as_deref());
        match d.numa_node {
            Some(n) => {
                self.u8(1);
                self.u64(n as u64);
            }
            None => self.u8(0),
        }
        self.pairs(d.attributes.len(), d.attributes.iter());
        self.edits(&d.edits);
        self.count(d.links.len());
        for (other, score) in &d.links {
            self.str(other);
            self.u32(*score);
        }
    }
    fn finish(mut self) -> Vec<u8> {
        let len = u32::try_from(self.0.len() - 4).unwrap_or(u32::MAX);
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

/// Reads one frame body (after the length prefix).
struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| Malformed(format!("truncated at byte {} (wanted {n} more)", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Result<bool, Malformed> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(Malformed(format!("flag byte {b} is neither 0 nor 1"))),
        }
    }
    fn u32(&mut self) -> Result<u32, Malformed> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, Malformed> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// A list length, checked against the bytes left so that a corrupt
    /// count cannot make us allocate gigabytes.
    fn count(&mut self, min_item: usize) -> Result<usize, Malformed> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.buf.len() - self.pos {
            return Err(Malformed(format!("list of {n} items does not fit in the frame")));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String, Malformed> {
        let n = self.count(1)?;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Malformed("string is not UTF-8".into()))
    }
    fn opt_str(&mut self) -> Result<Option<String>, Malformed> {
        if self.bool()? { self.str().map(Some) } else { Ok(None) }
    }
    fn strs(&mut self) -> Result<Vec<String>, Malformed> {
        let n = self.count(4)?;
        (0..n).map(|_| self.str()).collect()
    }
    fn pairs(&mut self) -> Result<Vec<(String, String)>, Malformed> {
        let n = self.count(8)?;
        (0..n).map(|_| Ok((self.str()?, self.str()?))).collect()
    }
    fn edits(&mut self) -> Result<Edits, Malformed> {
        let n = self.count(12)?;
        let device_nodes = (0..n)
            .map(|_| Ok(DeviceNode { host_path: self.str()?, container_path: self.str()?, permissions: self.str()? }))
            .collect::<Result<_, Malformed>>()?;
        let n = self.count(9)?;
        let mounts = (0..n)
            .map(|_| Ok(Mount { host_path: self.str()?, container_path: self.str()?, read_only: self.bool()? }))
            .collect::<Result<_, Malformed>>()?;
        Ok(Edits { device_nodes, mounts, envs: self.pairs()?, annotations: self.pairs()?, cdi_devices: self.strs()? })
    }
    fn device(&mut self) -> Result<Device, Malformed> {
        let id = self.str()?;
        let healthy = self.bool()?;
        let health_reason = self.opt_str()?;
        let numa_node = if self.bool()? { Some(self.u64()? as i64) } else { None };
        let attributes: BTreeMap<String, String> = self.pairs()?.into_iter().collect();
        let edits = self.edits()?;
        let n = self.count(8)?;
        let links = (0..n).map(|_| Ok((self.str()?, self.u32()?))).collect::<Result<_, Malformed>>()?;
        Ok(Device { id, healthy, health_reason, numa_node, attributes, edits, links })
    }
    fn end(&self) -> Result<(), Malformed> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            n => Err(Malformed(format!("{n} unexpected bytes at the end"))),
        }
    }
}

/// Splits a frame body into tag, ID and the decoder for the rest.
fn open(body: &[u8]) -> Result<(u8, u32, Dec<'_>), Malformed> {
    let mut d = Dec { buf: body, pos: 0 };
    let tag = d.u8()?;
    let id = d.u32()?;
    Ok((tag, id, d))
}

/// One request frame, ready to write.
pub fn request(id: u32, req: &Request) -> Vec<u8> {
    let (t, ids) = match req {
        Request::Create { .. } => (tag::CREATE, None),
        Request::WatchStart => (tag::WATCH_START, None),
        Request::Scan => (tag::SCAN, None),
        Request::Allocate { ids, .. } => (tag::ALLOCATE, Some(ids)),
        Request::Preferred { .. } => (tag::PREFERRED, None),
        Request::PreStart { ids } => (tag::PRE_START, Some(ids)),
        Request::Release { ids } => (tag::RELEASE, Some(ids)),
        Request::Shutdown => (tag::SHUTDOWN, None),
    };
    let mut e = Enc::new(t, id);
    if let Some(ids) = ids {
        e.strs(ids);
    }
    match req {
        Request::Create { options } => e.pairs(options.len(), options.iter().map(|(k, v)| (k, v))),
        Request::Allocate { parameters, .. } => e.opt_str(parameters.as_deref()),
        Request::Preferred { available, must, size } => {
            e.strs(available);
            e.strs(must);
            e.u32(*size);
        }
        _ => {}
    }
    e.finish()
}

pub fn decode_request(body: &[u8]) -> Result<(u32, Request), Malformed> {
    let (t, id, mut d) = open(body)?;
    let req = match t {
        tag::CREATE => Request::Create { options: d.pairs()? },
        tag::WATCH_START => Request::WatchStart,
        tag::SCAN => Request::Scan,
        tag::ALLOCATE => Request::Allocate { ids: d.strs()?, parameters: d.opt_str()? },
        tag::PREFERRED => Request::Preferred { available: d.strs()?, must: d.strs()?, size: d.u32()? },
        tag::PRE_START => Request::PreStart { ids: d.strs()? },
        tag::RELEASE => Request::Release { ids: d.strs()? },
        tag::SHUTDOWN => Request::Shutdown,
        other => return Err(Malformed(format!("unknown request tag {other}"))),
    };
    d.end()?;
    Ok((id, req))
}

pub fn hello(info: &ModuleInfo) -> Vec<u8> {
    let mut e = Enc::new(tag::HELLO, 0);
    e.u32(VERSION);
    e.str(&info.name);
    e.str(&info.version);
    e.str(&info.description);
    e.u32(u32::from(info.abi_major) << 16 | u32::from(info.abi_minor));
    let flags = [
        info.allocate,
        info.preferred_allocation,
        info.pre_start,
        info.watch,
        info.release,
        info.concurrent,
        info.claim_parameters,
        info.allocate_claims_only,
    ];
    for f in flags {
        e.u8(u8::from(f));
    }
    e.finish()
}

pub fn load_failed(message: &str) -> Vec<u8> {
    let mut e = Enc::new(tag::LOAD_FAILED, 0);
    e.str(message);
    e.finish()
}

pub fn reply(id: u32, status: u32, st: &CallState) -> Vec<u8> {
    let mut e = Enc::new(tag::REPLY, id);
    e.u32(status);
    e.opt_str(st.error.as_deref());
    e.count(st.devices.len());
    st.devices.iter().for_each(|d| e.device(d));
    e.edits(&st.edits);
    e.strs(&st.preferred);
    e.strs(&st.problems);
    e.finish()
}

pub fn log(level: u32, message: &str) -> Vec<u8> {
    let mut e = Enc::new(tag::LOG, 0);
    e.u32(level);
    e.str(message);
    e.finish()
}

pub fn changed() -> Vec<u8> {
    Enc::new(tag::CHANGED, 0).finish()
}

pub fn decode_message(body: &[u8]) -> Result<Message, Malformed> {
    let (t, id, mut d) = open(body)?;
    let msg = match t {
        tag::HELLO => {
            let version = d.u32()?;
            if version != VERSION {
                // The rest may be laid out differently: stop here.
                return Ok(Message::Hello { version, info: empty_info() });
            }
            let (name, ver, description) = (d.str()?, d.str()?, d.str()?);
            let abi = d.u32()?;
            let mut flag = || d.bool();
            let info = ModuleInfo {
                name,
                version: ver,
                description,
                abi_major: (abi >> 16) as u16,
                abi_minor: (abi & 0xffff) as u16,
                allocate: flag()?,
                preferred_allocation: flag()?,
                pre_start: flag()?,
                watch: flag()?,
                release: flag()?,
                concurrent: flag()?,
                claim_parameters: flag()?,
                allocate_claims_only: flag()?,
            };
            Message::Hello { version, info }
        }
        tag::LOAD_FAILED => Message::LoadFailed(d.str()?),
        tag::REPLY => {
            let status = d.u32()?;
            let mut state = CallState::default();
            state.error = d.opt_str()?;
            let n = d.count(16)?;
            state.devices = (0..n).map(|_| d.device()).collect::<Result<_, _>>()?;
            state.edits = d.edits()?;
            state.preferred = d.strs()?;
            state.problems = d.strs()?;
            Message::Reply { id, status, state }
        }
        tag::LOG => Message::Log { level: d.u32()?, message: d.str()? },
        tag::CHANGED => Message::Changed,
        other => return Err(Malformed(format!("unknown message tag {other}"))),
    };
    d.end()?;
    Ok(msg)
}

fn empty_info() -> ModuleInfo {
    ModuleInfo::default()
}

/// Reads one frame body; `None` at a clean end of stream (between frames).
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "stream ended inside a frame header")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes exceeds {MAX_FRAME}")));
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> Vec<u8> {
        let mut r = frame;
        let b = read_frame(&mut r).unwrap().unwrap();
        assert!(r.is_empty(), "length prefix must cover the whole frame");
        b
    }

    #[test]
    fn every_request_survives_the_round_trip() {
        let ids = vec!["a-0".to_string(), "ü-1".to_string()];
        let reqs = [
            Request::Create { options: vec![("count".into(), "4".into()), ("empty".into(), String::new())] },
            Request::WatchStart,
            Request::Scan,
            Request::Allocate { ids: ids.clone(), parameters: None },
            Request::Allocate { ids: ids.clone(), parameters: Some(r#"[{"sharing":"ü"}]"#.into()) },
            Request::Preferred { available: ids.clone(), must: vec!["a-0".into()], size: 7 },
            Request::PreStart { ids: ids.clone() },
            Request::Release { ids: vec![] },
            Request::Shutdown,
        ];
        for (i, req) in reqs.into_iter().enumerate() {
            let id = 1000 + i as u32;
            assert_eq!(decode_request(&body(&request(id, &req))).unwrap(), (id, req));
        }
    }

    #[test]
    fn reply_keeps_devices_edits_and_problems() {
        let edits = Edits {
            device_nodes: vec![DeviceNode {
                host_path: "/dev/x".into(),
                container_path: "/dev/y".into(),
                permissions: "rw".into(),
            }],
            mounts: vec![Mount { host_path: "/h".into(), container_path: "/c".into(), read_only: true }],
            envs: vec![("K".into(), "v".into())],
            annotations: vec![("a.io/b".into(), "1".into())],
            cdi_devices: vec!["v.com/c=0".into()],
        };
        let dev = Device {
            id: "d-0".into(),
            healthy: false,
            health_reason: Some("overheated".into()),
            numa_node: Some(3),
            attributes: [("model".to_string(), "m".to_string())].into(),
            edits: edits.clone(),
            links: vec![("d-1".into(), 10)],
        };
        let mut st = CallState::default();
        st.error = Some("boom".into());
        st.devices = vec![
            dev.clone(),
            Device { id: "d-1".into(), numa_node: None, healthy: true, health_reason: None, ..dev.clone() },
        ];
        st.edits = edits.clone();
        st.preferred = vec!["d-1".into()];
        st.problems = vec!["bad id".into()];
        let Message::Reply { id, status, state } = decode_message(&body(&reply(9, 5, &st))).unwrap() else {
            panic!("not a reply")
        };
        assert_eq!((id, status), (9, 5));
        assert_eq!(state.error.as_deref(), Some("boom"));
        assert_eq!(state.devices, st.devices);
        assert_eq!(state.edits, edits);
        assert_eq!(state.preferred, st.preferred);
        assert_eq!(state.problems, st.problems);
    }

    #[test]
    fn hello_carries_the_module_facts() {
        let info =
            ModuleInfo { name: "x".into(), abi_major: 1, abi_minor: 1, pre_start: true, release: true, ..empty_info() };
        let Message::Hello { version, info: got } = decode_message(&body(&hello(&info))).unwrap() else { panic!() };
        assert_eq!(version, VERSION);
        assert_eq!(got, info);
    }

    #[test]
    fn truncated_or_padded_frames_are_errors_not_panics() {
        let full = body(&request(1, &Request::Allocate { ids: vec!["abc".into()], parameters: None }));
        for cut in 0..full.len() {
            assert!(decode_request(&full[..cut]).is_err(), "cut at {cut} decoded");
        }
        let mut padded = full.clone();
        padded.push(0);
        assert!(decode_request(&padded).unwrap_err().to_string().contains("unexpected bytes"));
    }

    #[test]
    fn a_huge_count_is_refused_before_allocating() {
        let mut b = vec![tag::ALLOCATE, 1, 0, 0, 0];
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_request(&b).unwrap_err().to_string().contains("does not fit"));
    }

    #[test]
    fn stream_end_between_frames_is_clean_and_inside_one_is_an_error() {
        let frame = changed();
        assert!(read_frame(&mut &[][..]).unwrap().is_none());
        assert!(read_frame(&mut &frame[..2]).is_err());
        let mut big = &(u32::MAX).to_le_bytes()[..];
        assert_eq!(read_frame(&mut big).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }
}
