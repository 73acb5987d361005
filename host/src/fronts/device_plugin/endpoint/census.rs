//! Reading a request message without decoding it: which call it is for, and how many container
//! requests and device IDs it names, counted on the protobuf wire. Decoding can cost twenty times
//! a message's bytes (a 4 MiB message of one-byte IDs is a million strings), so [`intake`] counts
//! a large message first and refuses one that no valid request could look like.
//!
//! [`intake`]: super::intake

/// The largest request message accepted: the kubelet's own gRPC receive limit. Our device list
/// reaches the kubelet only under it, so no request naming those devices is larger.
pub const MAX_MESSAGE: usize = 4 << 20;

/// Container requests accepted in one Allocate or GetPreferredAllocation (the kubelet sends one).
pub const MAX_CONTAINERS: usize = 256;
/// The longest device ID a request may name: the host advertises IDs of at most 63 bytes (the
/// API's limit) plus a replica suffix (`::1023`).
pub const MAX_ID: usize = 63 + 6;
/// The largest message of the calls whose request is `Empty` (ListAndWatch, GetDevicePluginOptions).
const MAX_EMPTY: usize = 1 << 10;

/// The DevicePlugin calls, as far as their requests differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Allocate,
    Preferred,
    PreStart,
    /// ListAndWatch: an `Empty` request, answered by a long-lived stream.
    Watch,
    /// GetDevicePluginOptions (or a method we do not serve): an `Empty` request.
    Empty,
}

impl Call {
    pub fn of(path: &str) -> Call {
        match path.strip_prefix("/v1beta1.DevicePlugin/") {
            Some("Allocate") => Call::Allocate,
            Some("GetPreferredAllocation") => Call::Preferred,
            Some("PreStartContainer") => Call::PreStart,
            Some("ListAndWatch") => Call::Watch,
            _ => Call::Empty,
        }
    }

    /// The largest request message accepted for this call.
    pub fn limit(self) -> usize {
        if matches!(self, Call::Watch | Call::Empty) { MAX_EMPTY } else { MAX_MESSAGE }
    }

    /// The call's name, as error messages say it.
    pub fn name(self) -> &'static str {
        match self {
            Call::Allocate => "Allocate",
            Call::Preferred => "GetPreferredAllocation",
            Call::PreStart => "PreStartContainer",
            Call::Watch => "ListAndWatch",
            Call::Empty => "request",
        }
    }
}

/// What a request message holds, counted on the wire without decoding it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    pub containers: usize,
    /// Device IDs in all container requests (both lists of GetPreferredAllocation).
    pub ids: usize,
    /// Device IDs in the fullest container request.
    pub most_in_one: usize,
    /// Bytes of the longest device ID.
    pub longest: usize,
}

/// One field of a protobuf message: its number and, for length-delimited ones, the bytes.
enum Field<'a> {
    Scalar,
    Bytes(&'a [u8]),
}

fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first()?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

/// The fields of one message, in wire order; an error for bytes that are not protobuf.
fn fields(mut buf: &[u8]) -> impl Iterator<Item = Result<(u64, Field<'_>), String>> {
    std::iter::from_fn(move || {
        if buf.is_empty() {
            return None;
        }
        let malformed = |what: &str| Some(Err(format!("malformed message ({what})")));
        let Some(key) = varint(&mut buf) else { return malformed("truncated field key") };
        let (number, wire) = (key >> 3, key & 7);
        if number == 0 {
            return malformed("field number 0");
        }
        let skip = match wire {
            0 => {
                return if varint(&mut buf).is_some() {
                    Some(Ok((number, Field::Scalar)))
                } else {
                    malformed("truncated varint")
                };
            }
            1 => 8,
            5 => 4,
            2 => {
                let Some(len) = varint(&mut buf).and_then(|l| usize::try_from(l).ok()).filter(|&l| l <= buf.len())
                else {
                    return malformed("length past the end");
                };
                let (bytes, rest) = buf.split_at(len);
                buf = rest;
                return Some(Ok((number, Field::Bytes(bytes))));
            }
            _ => return malformed("unsupported wire type"),
        };
        if buf.len() < skip {
            return malformed("truncated fixed-size field");
        }
        buf = &buf[skip..];
        Some(Ok((number, Field::Scalar)))
    })
}

/// Counts the container requests and device IDs of a request message of `call`.
pub fn census(call: Call, msg: &[u8]) -> Result<Census, String> {
    let mut c = Census::default();
    for field in fields(msg) {
        let (number, Field::Bytes(inner)) = field? else { continue };
        if number != 1 {
            continue;
        }
        match call {
            Call::PreStart => {
                c.ids += 1;
                c.most_in_one = c.ids;
                c.longest = c.longest.max(inner.len());
            }
            Call::Allocate | Call::Preferred => {
                c.containers += 1;
                let mut here = 0;
                for field in fields(inner) {
                    // Allocate: devices_ids = 1; GetPreferredAllocation: available = 1, must_include = 2.
                    if let (1 | 2, Field::Bytes(id)) = field? {
                        here += 1;
                        c.longest = c.longest.max(id.len());
                    }
                }
                c.ids += here;
                c.most_in_one = c.most_in_one.max(here);
            }
            Call::Watch | Call::Empty => {}
        }
    }
    Ok(c)
}

/// Whether a request with `census` can be valid for a resource advertising `advertised` device
/// IDs: each ID may be named once per call (twice in GetPreferredAllocation: available and
/// must-include), so a request naming more cannot be, and is refused before it is decoded.
pub fn admissible(call: Call, c: Census, advertised: usize) -> Result<(), String> {
    let what = call.name();
    if c.containers > MAX_CONTAINERS {
        return Err(format!(
            "{what} request has {} container requests, more than the {MAX_CONTAINERS} accepted (the kubelet sends one)",
            c.containers
        ));
    }
    if c.longest > MAX_ID {
        return Err(format!(
            "{what} request names a device ID of {} bytes; device IDs have at most {MAX_ID} bytes",
            c.longest
        ));
    }
    let (named, most) = match call {
        Call::Preferred => (c.most_in_one, 2 * advertised),
        _ => (c.ids, advertised),
    };
    if named > most {
        return Err(format!(
            "{what} request names {named} device IDs{}, more than the {advertised} device IDs the resource \
             advertises could make valid; refused unread",
            if call == Call::Preferred { " in one container request" } else { "" }
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
