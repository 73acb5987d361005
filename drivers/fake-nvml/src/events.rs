//! Event calls of the fake: event sets, registration, and a wait that
//! follows the control file (sleeping on its inotify watch, see `wake`).

use crate::ffi::*;
use crate::state::{ALL_EVENTS, EventSet, OLD_GPU_EVENTS, Runtime};
use crate::wake::ControlWatch;
use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_uint, c_ulonglong};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---- events ----------------------------------------------------------------

fn set_index(rt: &Runtime, set: nvmlEventSet_t) -> Result<usize, Ret> {
    set.addr().checked_sub(1).filter(|&i| rt.sets.get(i).is_some_and(Option::is_some)).ok_or(INVALID_ARGUMENT)
}

/// # Safety
/// `set` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> Ret {
    with_rt(|rt| {
        if let Some(code) = rt.machine.event_set_error {
            return Err(code);
        }
        rt.sets.push(Some(EventSet::default()));
        // SAFETY: forwarded caller contract.
        unsafe { put(set, std::ptr::without_provenance_mut(rt.sets.len())) }
    })
}

/// # Safety
/// `types` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, types: *mut c_ulonglong) -> Ret {
    with_rt(|rt| {
        let gpu = &rt.machine.gpus[whole_gpu(rt, device)?];
        // SAFETY: forwarded caller contract.
        unsafe { put(types, if gpu.events { ALL_EVENTS } else { OLD_GPU_EVENTS }) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, types: c_ulonglong, set: nvmlEventSet_t) -> Ret {
    with_rt(|rt| {
        let g = whole_gpu(rt, device)?;
        let i = set_index(rt, set)?;
        let supported = if rt.machine.gpus[g].events { ALL_EVENTS } else { OLD_GPU_EVENTS };
        if types & !supported != 0 {
            return Err(NOT_SUPPORTED);
        }
        if let Some(s) = rt.sets[i].as_mut() {
            s.registered.push((g, types));
        }
        Ok(())
    })
}

/// # Safety
/// `data` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> Ret {
    if data.is_null() {
        return INVALID_ARGUMENT;
    }
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    loop {
        let mut event = None;
        let mut watch = None;
        let code = with_rt(|rt| {
            let i = set_index(rt, set)?;
            let path = rt.control_path().map(Path::to_path_buf);
            let Some(s) = rt.sets[i].as_mut() else { return Err(INVALID_ARGUMENT) };
            if std::mem::take(&mut s.lost_pending) {
                return Err(GPU_IS_LOST);
            }
            event = s.queue.pop_front();
            if event.is_none() && s.watch.is_none() {
                // Armed before the caller sleeps: a line written from now on wakes it.
                s.watch = path.as_deref().and_then(ControlWatch::new).map(Arc::new);
            }
            watch = s.watch.clone();
            Ok(())
        });
        if code != SUCCESS {
            return code;
        }
        if let Some(e) = event {
            let out = nvmlEventData_t {
                device: gpu_handle(e.gpu),
                eventType: e.event_type,
                eventData: e.data,
                gpuInstanceId: e.gpu_instance,
                computeInstanceId: e.compute_instance,
            };
            // SAFETY: checked non-null; valid per the contract.
            unsafe { data.write(out) };
            return SUCCESS;
        }
        let now = Instant::now();
        if now >= deadline {
            return TIMEOUT;
        }
        // Sleep without holding the lock, so other calls proceed: on the
        // control file's inotify descriptor when there is one (no CPU until a
        // line arrives), else on a timer.
        match watch {
            Some(w) => {
                w.wait(deadline - now);
            }
            None => std::thread::sleep(WAIT_POLL.min(deadline - now)),
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> Ret {
    with_rt(|rt| {
        let i = set_index(rt, set)?;
        rt.sets[i] = None;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::{nvmlInit_v2, nvmlShutdown};
    use std::io::Write;

    /// The only test in this crate that touches the global state.
    #[test]
    fn the_wait_blocks_until_a_control_line_or_its_timeout() {
        let dir = std::env::temp_dir().join(format!("fake-nvml-wait-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let machine = dir.join("m.toml");
        std::fs::write(
            &machine,
            "control = \"ctl\"\n[[gpu]]\nuuid = \"GPU-a\"\nname = \"n\"\nmemory_mib = 1\npci_bus_id = \"0:1:0.0\"\nminor = 0\n",
        )
        .unwrap();
        std::fs::write(dir.join("ctl"), "").unwrap();
        // SAFETY: no other test of this crate reads the environment.
        unsafe { std::env::set_var(crate::machine::MACHINE_ENV, &machine) };
        assert_eq!(nvmlInit_v2(), SUCCESS);
        let mut set: nvmlEventSet_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { nvmlEventSetCreate(&mut set) }, SUCCESS);
        assert_eq!(nvmlDeviceRegisterEvents(gpu_handle(0), crate::state::XID_EVENT, set), SUCCESS);
        // SAFETY: an all-zero event record is valid; the pointer outlives each call.
        let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
        let wait = |ms, data: &mut nvmlEventData_t| {
            let t = Instant::now();
            // SAFETY: valid out-pointer.
            (unsafe { nvmlEventSetWait_v2(set, data, ms) }, t.elapsed())
        };

        let (code, took) = wait(0, &mut data);
        assert_eq!(code, TIMEOUT);
        assert!(took < Duration::from_millis(200), "a zero timeout waited {took:?}");
        let (code, took) = wait(300, &mut data);
        assert_eq!(code, TIMEOUT);
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "{took:?}");
        // Blocked, not polling: a long quiet wait puts the thread to sleep once.
        let switches = || {
            let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:")).unwrap().to_string();
            line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap()
        };
        let before = switches();
        assert_eq!(wait(1500, &mut data).0, TIMEOUT);
        let slept = switches() - before;
        assert!(slept <= 2, "a quiet 1.5 s wait woke {slept} times: it polls");

        let ctl = dir.join("ctl");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            std::fs::OpenOptions::new().append(true).open(&ctl).unwrap().write_all(b"xid 0 79\n").unwrap();
        });
        let (code, took) = wait(20_000, &mut data);
        writer.join().unwrap();
        assert_eq!(code, SUCCESS);
        assert_eq!(data.eventData, 79);
        assert!(took < Duration::from_secs(5), "the line took {took:?} to wake the wait");

        let mut f = std::fs::OpenOptions::new().append(true).open(dir.join("ctl")).unwrap();
        f.write_all(b"lost 0\n").unwrap();
        let (code, took) = wait(20_000, &mut data);
        assert_eq!(code, GPU_IS_LOST);
        assert!(took < Duration::from_secs(5));
        f.write_all(b"back 0\nvanish 0\n").unwrap();
        let (code, _) = wait(300, &mut data);
        assert_eq!(code, TIMEOUT, "a vanished GPU must not be reported by the wait");

        assert_eq!(nvmlEventSetFree(set), SUCCESS);
        assert_eq!(nvmlShutdown(), SUCCESS);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
