//! The host side of one driver call: the `devhost_call` state and the
//! `extern "C"` callbacks a driver uses to report devices, edits and errors.
//! Every callback validates its input, never unwinds into the driver, and
//! only touches the call it was handed.

use crate::driver::device::{Device, DeviceNode, Edits, MAX_DEVICES, Mount};
use devhost_abi as abi;
use std::collections::{BTreeMap, HashSet};
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

pub use crate::driver::host_ctx::{HostCtx, IN_SCAN, ScanGuard, emit_log};
use crate::driver::host_ctx::{devices_changed, log};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    Create,
    Scan,
    Allocate,
    Preferred,
    PreStart,
    Watch,
    Release,
}

/// What one call collected. Behind a mutex because a driver may emit from
/// helper threads while its call is running.
#[derive(Default)]
pub struct CallState {
    pub error: Option<String>,
    pub devices: Vec<Device>,
    pub edits: Edits,
    pub preferred: Vec<String>,
    /// Problems with what the driver emitted (logged by the caller).
    pub problems: Vec<String>,
    /// Problems beyond MAX_PROBLEMS, counted rather than kept.
    suppressed: usize,
    /// Whether MAX_DEVICES was reached in this scan.
    capped: bool,
    seen_ids: HashSet<String>,
    /// Whether the device being built was rejected (its details are dropped).
    current_rejected: bool,
}

/// At most this many emission problems are kept per call: a driver that
/// emits a million bad IDs gets a summary, not a million log lines.
pub const MAX_PROBLEMS: usize = 20;

impl CallState {
    pub fn problem(&mut self, p: String) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(p);
        } else {
            self.suppressed += 1;
        }
    }
}

pub struct CallCtx {
    pub kind: CallKind,
    pub state: Mutex<CallState>,
    /// The DRA claim's parameters an allocate hands out (`claim_parameters`, ABI 1.3); `None`
    /// for a device-plugin container. Never changed during the call, so a driver may read it
    /// from any thread while the call runs.
    parameters: Option<String>,
}

impl CallCtx {
    pub fn new(kind: CallKind) -> Self {
        CallCtx { kind, state: Mutex::new(CallState::default()), parameters: None }
    }

    /// An allocate call for a DRA claim with `parameters` (a JSON array).
    pub fn with_parameters(kind: CallKind, parameters: Option<String>) -> Self {
        CallCtx { parameters, ..CallCtx::new(kind) }
    }

    pub fn as_raw(&self) -> *mut abi::devhost_call {
        self as *const CallCtx as *mut abi::devhost_call
    }

    pub fn into_state(self) -> CallState {
        let mut st = self.state.into_inner().unwrap_or_else(|poison| poison.into_inner());
        if self.kind == CallKind::Scan {
            unknown_links(&mut st);
        }
        if st.suppressed > 0 {
            let n = std::mem::take(&mut st.suppressed);
            st.problems.push(format!("... and {n} more problem(s) in the same call"));
        }
        st
    }
}

/// A link to an ID the scan does not report (a misspelt ID, a device that
/// was dropped) counts for nothing in preferred allocation: say so, once per
/// link, instead of ignoring it silently.
fn unknown_links(st: &mut CallState) {
    let known: HashSet<&str> = st.devices.iter().map(|d| d.id.as_str()).collect();
    let unknown: Vec<String> = st
        .devices
        .iter()
        .flat_map(|d| d.links.iter().map(move |(other, _)| (d, other)))
        .filter(|(_, other)| !known.contains(other.as_str()))
        .map(|(d, other)| format!("device {:?}: link to {other:?}, which this scan does not report, is ignored", d.id))
        .collect();
    for p in unknown {
        st.problem(p);
    }
}

/// Checks a device ID as the kubelet and our replicas need it.
pub fn check_device_id(id: &str) -> Result<(), &'static str> {
    if id.is_empty() {
        return Err("empty device ID");
    }
    if id.len() > 63 {
        return Err("device ID longer than 63 bytes");
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("device ID has spaces or non-printable characters");
    }
    if id.contains("::") {
        return Err("device ID contains the reserved \"::\"");
    }
    Ok(())
}

/// Runs a callback body with the call's state, converting panics and misuse
/// into status codes.
fn with_call(
    call: *mut abi::devhost_call,
    f: impl FnOnce(CallKind, &mut CallState) -> abi::devhost_status,
) -> abi::devhost_status {
    if call.is_null() {
        return abi::DEVHOST_ERR_INVALID_ARGUMENT;
    }
    // SAFETY: the handle is a &CallCtx the host created for a call in progress.
    let ctx = unsafe { &*(call as *const CallCtx) };
    catch_unwind(AssertUnwindSafe(|| {
        let mut st = ctx.state.lock().unwrap_or_else(|p| p.into_inner());
        f(ctx.kind, &mut st)
    }))
    .unwrap_or(abi::DEVHOST_ERR_INTERNAL)
}

/// Reads a borrowed string, or None when NULL with a length or not UTF-8.
fn text(s: abi::devhost_str) -> Option<String> {
    // SAFETY: the ABI says the bytes are valid for the duration of the callback.
    let bytes = unsafe { s.as_bytes() }?;
    std::str::from_utf8(bytes).ok().map(str::to_owned)
}

macro_rules! strs {
    ($st:ident, $what:literal, $($s:ident),+) => {
        ($(match text($s) {
            Some(v) => v,
            None => {
                $st.problem(format!("{}: {} is not valid UTF-8 (or NULL)", $what, stringify!($s)));
                return abi::DEVHOST_ERR_INVALID_ARGUMENT;
            }
        }),+)
    };
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn set_error(call: *mut abi::devhost_call, message: abi::devhost_str) {
    with_call(call, |_, st| {
        // Keep whatever is readable: an error message is for humans.
        // SAFETY: borrowed for the callback.
        let bytes = unsafe { message.as_bytes() }.unwrap_or(b"(NULL message)");
        st.error = Some(String::from_utf8_lossy(bytes).into_owned());
        abi::DEVHOST_OK
    });
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn device_begin(
    call: *mut abi::devhost_call,
    id: abi::devhost_str,
    health: abi::devhost_health,
    numa_node: i32,
) -> abi::devhost_status {
    with_call(call, |kind, st| {
        if kind != CallKind::Scan {
            st.problem("device_begin called outside scan".into());
            return abi::DEVHOST_ERR_FAILED_PRECONDITION;
        }
        if st.devices.len() >= MAX_DEVICES {
            if !std::mem::replace(&mut st.capped, true) {
                st.problem(format!("more than {MAX_DEVICES} devices in one scan; the rest are ignored"));
            }
            st.current_rejected = true;
            return abi::DEVHOST_ERR_RESOURCE_EXHAUSTED;
        }
        let id = strs!(st, "device_begin", id);
        if let Err(why) = check_device_id(&id) {
            st.problem(format!("device {id:?} dropped: {why}"));
            st.current_rejected = true;
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        if !st.seen_ids.insert(id.clone()) {
            st.problem(format!("device {id:?} dropped: duplicate ID in one scan"));
            st.current_rejected = true;
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        if numa_node < abi::DEVHOST_NUMA_NONE {
            st.problem(format!("device {id:?}: NUMA node {numa_node} is invalid, using none"));
        }
        st.current_rejected = false;
        st.devices.push(Device {
            id,
            healthy: health == abi::DEVHOST_HEALTH_HEALTHY,
            health_reason: None,
            numa_node: (numa_node >= 0).then_some(i64::from(numa_node)),
            attributes: BTreeMap::new(),
            edits: Edits::default(),
            links: Vec::new(),
        });
        abi::DEVHOST_OK
    })
}

/// The device the scan is describing, or the reason there is none.
fn current_device(kind: CallKind, st: &mut CallState, what: &str) -> Result<usize, abi::devhost_status> {
    if kind != CallKind::Scan || st.devices.is_empty() && !st.current_rejected {
        st.problem(format!("{what} called before device_begin or outside scan"));
        return Err(abi::DEVHOST_ERR_FAILED_PRECONDITION);
    }
    if st.current_rejected {
        // Details of a dropped device are ignored quietly: it was reported once.
        return Err(abi::DEVHOST_ERR_INVALID_ARGUMENT);
    }
    Ok(st.devices.len() - 1)
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn device_attr(
    call: *mut abi::devhost_call,
    key: abi::devhost_str,
    value: abi::devhost_str,
) -> abi::devhost_status {
    with_call(call, |kind, st| {
        let i = match current_device(kind, st, "device_attr") {
            Ok(i) => i,
            Err(s) => return s,
        };
        let (key, value) = strs!(st, "device_attr", key, value);
        if key.is_empty() {
            st.problem(format!("device {:?}: attribute with an empty key ignored", st.devices[i].id));
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        st.devices[i].attributes.insert(key, value);
        abi::DEVHOST_OK
    })
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn device_link(
    call: *mut abi::devhost_call,
    other: abi::devhost_str,
    score: u32,
) -> abi::devhost_status {
    with_call(call, |kind, st| {
        let i = match current_device(kind, st, "device_link") {
            Ok(i) => i,
            Err(s) => return s,
        };
        let other = strs!(st, "device_link", other);
        st.devices[i].links.push((other, score));
        abi::DEVHOST_OK
    })
}

/// The longest health reason kept; a longer one is cut at a character boundary.
pub const MAX_HEALTH_REASON: usize = 256;

/// `reason` cut to [`MAX_HEALTH_REASON`] bytes, with its line breaks and control characters made
/// spaces (it ends up in one log line).
fn health_reason_text(reason: &str) -> String {
    let mut end = reason.len().min(MAX_HEALTH_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].chars().map(|c| if c.is_control() { ' ' } else { c }).collect::<String>().trim().to_string()
}

/// # Safety
/// Called by a driver per the ABI (1.2): `call` is the live handle of the call in
/// progress and `reason` is readable for the callback.
pub unsafe extern "C" fn device_health_reason(
    call: *mut abi::devhost_call,
    reason: abi::devhost_str,
) -> abi::devhost_status {
    with_call(call, |kind, st| {
        let i = match current_device(kind, st, "device_health_reason") {
            Ok(i) => i,
            Err(s) => return s,
        };
        let reason = strs!(st, "device_health_reason", reason);
        let reason = health_reason_text(&reason);
        st.devices[i].health_reason = (!reason.is_empty()).then_some(reason);
        abi::DEVHOST_OK
    })
}

/// # Safety
/// Called by a driver per the ABI (1.3): `call` is the live handle of the call in progress and
/// `out` is writable for one `devhost_str`.
pub unsafe extern "C" fn claim_parameters(
    call: *mut abi::devhost_call,
    out: *mut abi::devhost_str,
) -> abi::devhost_status {
    if call.is_null() || out.is_null() {
        return abi::DEVHOST_ERR_INVALID_ARGUMENT;
    }
    // SAFETY: the handle is a &CallCtx the host created for a call in progress; its
    // `parameters` outlive the call, so the borrowed text stays valid until it returns.
    let ctx = unsafe { &*(call as *const CallCtx) };
    let (status, text) = match (ctx.kind, &ctx.parameters) {
        (CallKind::Allocate, Some(json)) => (abi::DEVHOST_OK, abi::devhost_str::from_str(json)),
        (CallKind::Allocate, None) => (abi::DEVHOST_ERR_NOT_FOUND, abi::devhost_str::from_str("")),
        _ => {
            let mut st = ctx.state.lock().unwrap_or_else(|p| p.into_inner());
            st.problem("claim_parameters called outside allocate".to_owned());
            (abi::DEVHOST_ERR_FAILED_PRECONDITION, abi::devhost_str::from_str(""))
        }
    };
    // SAFETY: `out` is writable (the caller's promise, checked non-null above).
    unsafe { out.write(text) };
    status
}

/// The edits a callback should add to: the current device in scan, the
/// response in allocate.
fn edits_target<'a>(kind: CallKind, st: &'a mut CallState, what: &str) -> Result<&'a mut Edits, abi::devhost_status> {
    match kind {
        CallKind::Allocate => Ok(&mut st.edits),
        CallKind::Scan => {
            let i = current_device(kind, st, what)?;
            Ok(&mut st.devices[i].edits)
        }
        _ => {
            st.problem(format!("{what} called outside scan and allocate"));
            Err(abi::DEVHOST_ERR_FAILED_PRECONDITION)
        }
    }
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn add_device_node(
    call: *mut abi::devhost_call,
    host_path: abi::devhost_str,
    container_path: abi::devhost_str,
    permissions: abi::devhost_str,
) -> abi::devhost_status {
    with_call(call, |kind, st| {
        let (host_path, container_path, permissions) =
            strs!(st, "add_device_node", host_path, container_path, permissions);
        if !host_path.starts_with('/') || !(container_path.is_empty() || container_path.starts_with('/')) {
            st.problem(format!("device node {host_path:?} -> {container_path:?} ignored: paths must be absolute"));
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        if host_path.is_empty() || !permissions.chars().all(|c| matches!(c, 'r' | 'w' | 'm')) {
            st.problem(format!(
                "device node {host_path:?} ignored: empty path or permissions {permissions:?} not within \"rwm\""
            ));
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        let container_path = if container_path.is_empty() { host_path.clone() } else { container_path };
        let permissions = if permissions.is_empty() { "rw".to_string() } else { permissions };
        match edits_target(kind, st, "add_device_node") {
            Ok(e) => {
                e.device_nodes.push(DeviceNode { host_path, container_path, permissions });
                abi::DEVHOST_OK
            }
            Err(s) => s,
        }
    })
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn add_mount(
    call: *mut abi::devhost_call,
    host_path: abi::devhost_str,
    container_path: abi::devhost_str,
    read_only: u32,
) -> abi::devhost_status {
    with_call(call, |kind, st| {
        let (host_path, container_path) = strs!(st, "add_mount", host_path, container_path);
        if !host_path.starts_with('/') || !container_path.starts_with('/') {
            st.problem(format!("mount {host_path:?} -> {container_path:?} ignored: paths must be absolute"));
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        match edits_target(kind, st, "add_mount") {
            Ok(e) => {
                e.mounts.push(Mount { host_path, container_path, read_only: read_only != 0 });
                abi::DEVHOST_OK
            }
            Err(s) => s,
        }
    })
}

fn add_pair(
    call: *mut abi::devhost_call,
    key: abi::devhost_str,
    value: abi::devhost_str,
    env: bool,
) -> abi::devhost_status {
    let what = if env { "add_env" } else { "add_annotation" };
    with_call(call, |kind, st| {
        let (key, value) = strs!(st, "add_env/add_annotation", key, value);
        if key.is_empty() || (env && key.contains('=')) {
            st.problem(format!("{what}: key {key:?} ignored (empty or contains '=')"));
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        match edits_target(kind, st, what) {
            Ok(e) => {
                let list = if env { &mut e.envs } else { &mut e.annotations };
                match list.iter_mut().find(|(k, _)| *k == key) {
                    Some(entry) => entry.1 = value,
                    None => list.push((key, value)),
                }
                abi::DEVHOST_OK
            }
            Err(s) => s,
        }
    })
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn add_env(
    call: *mut abi::devhost_call,
    key: abi::devhost_str,
    value: abi::devhost_str,
) -> abi::devhost_status {
    add_pair(call, key, value, true)
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn add_annotation(
    call: *mut abi::devhost_call,
    key: abi::devhost_str,
    value: abi::devhost_str,
) -> abi::devhost_status {
    add_pair(call, key, value, false)
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn add_cdi_device(call: *mut abi::devhost_call, name: abi::devhost_str) -> abi::devhost_status {
    with_call(call, |kind, st| {
        let name = strs!(st, "add_cdi_device", name);
        if !name.contains('/') || !name.contains('=') {
            st.problem(format!("CDI name {name:?} ignored: expected vendor.com/class=name"));
            return abi::DEVHOST_ERR_INVALID_ARGUMENT;
        }
        match edits_target(kind, st, "add_cdi_device") {
            Ok(e) => {
                if !e.cdi_devices.contains(&name) {
                    e.cdi_devices.push(name);
                }
                abi::DEVHOST_OK
            }
            Err(s) => s,
        }
    })
}

/// # Safety
/// Called by a driver per the ABI: `call` is the live handle of the call in
/// progress and every string argument is readable for the callback.
pub unsafe extern "C" fn prefer_device(call: *mut abi::devhost_call, id: abi::devhost_str) -> abi::devhost_status {
    with_call(call, |kind, st| {
        if kind != CallKind::Preferred {
            st.problem("prefer_device called outside preferred_allocation".into());
            return abi::DEVHOST_ERR_FAILED_PRECONDITION;
        }
        let id = strs!(st, "prefer_device", id);
        st.preferred.push(id);
        abi::DEVHOST_OK
    })
}

/// The host API table for one instance.
pub fn host_api(ctx: *mut c_void) -> abi::devhost_host_api {
    abi::devhost_host_api {
        struct_size: std::mem::size_of::<abi::devhost_host_api>() as u32,
        abi_major: abi::DEVHOST_ABI_MAJOR,
        abi_minor: abi::DEVHOST_ABI_MINOR,
        host_ctx: ctx,
        log: Some(log),
        devices_changed: Some(devices_changed),
        set_error: Some(set_error),
        device_begin: Some(device_begin),
        device_attr: Some(device_attr),
        device_link: Some(device_link),
        add_device_node: Some(add_device_node),
        add_mount: Some(add_mount),
        add_env: Some(add_env),
        add_annotation: Some(add_annotation),
        add_cdi_device: Some(add_cdi_device),
        prefer_device: Some(prefer_device),
        device_health_reason: Some(device_health_reason),
        claim_parameters: Some(claim_parameters),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_health_reason_belongs_to_the_current_device_cleaned_and_cut() {
        let ctx = CallCtx::new(CallKind::Scan);
        let s = abi::devhost_str::from_str;
        // SAFETY: a live call handle and borrowed strings, as a driver would pass them.
        unsafe {
            assert_eq!(device_health_reason(ctx.as_raw(), s("early")), abi::DEVHOST_ERR_FAILED_PRECONDITION);
            device_begin(ctx.as_raw(), s("gpu-0"), abi::DEVHOST_HEALTH_UNHEALTHY, -1);
            assert_eq!(device_health_reason(ctx.as_raw(), s("critical\nXid 79 ")), abi::DEVHOST_OK);
            device_begin(ctx.as_raw(), s("gpu-1"), abi::DEVHOST_HEALTH_UNHEALTHY, -1);
            device_health_reason(ctx.as_raw(), s(&"é".repeat(200)));
            device_begin(ctx.as_raw(), s("gpu-2"), abi::DEVHOST_HEALTH_HEALTHY, -1);
            device_health_reason(ctx.as_raw(), s(""));
        }
        let st = ctx.into_state();
        assert_eq!(st.devices[0].health_reason.as_deref(), Some("critical Xid 79"));
        let long = st.devices[1].health_reason.as_deref().unwrap();
        assert!(long.len() <= MAX_HEALTH_REASON && long.starts_with("éé"), "{long}");
        assert_eq!(st.devices[2].health_reason, None);
        assert_eq!(st.problems.len(), 1, "{:?}", st.problems);
    }

    #[test]
    fn claim_parameters_are_the_claims_in_allocate_absent_for_a_container_and_refused_elsewhere() {
        let read = |ctx: &CallCtx| {
            let mut out = abi::devhost_str::from_str("stale");
            // SAFETY: a live call handle and a writable out slot.
            let status = unsafe { claim_parameters(ctx.as_raw(), &mut out) };
            // SAFETY: the text borrows ctx, alive here.
            (status, unsafe { out.as_bytes() }.map(|b| String::from_utf8_lossy(b).into_owned()))
        };
        let claim = CallCtx::with_parameters(CallKind::Allocate, Some(r#"[{"a":1}]"#.into()));
        assert_eq!(read(&claim), (abi::DEVHOST_OK, Some(r#"[{"a":1}]"#.to_owned())));
        let container = CallCtx::new(CallKind::Allocate);
        assert_eq!(read(&container), (abi::DEVHOST_ERR_NOT_FOUND, Some(String::new())));
        let scan = CallCtx::new(CallKind::Scan);
        assert_eq!(read(&scan).0, abi::DEVHOST_ERR_FAILED_PRECONDITION);
        assert_eq!(scan.into_state().problems, ["claim_parameters called outside allocate"]);
        // SAFETY: null handles are refused without a write.
        assert_eq!(
            unsafe { claim_parameters(std::ptr::null_mut(), std::ptr::null_mut()) },
            abi::DEVHOST_ERR_INVALID_ARGUMENT
        );
    }
}
