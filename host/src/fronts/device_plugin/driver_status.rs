//! A driver call's error as the gRPC status a kubelet call gets: the driver side speaks no gRPC,
//! so its errors (`driver::call::CallError`) are mapped here, at the front.

use crate::driver::call::CallError;
use devhost_abi as abi;
use tonic::{Code, Status};

impl From<&CallError> for Status {
    fn from(e: &CallError) -> Status {
        let code = match e {
            CallError::Status { code, .. } => match *code {
                abi::DEVHOST_ERR_INVALID_ARGUMENT => Code::InvalidArgument,
                abi::DEVHOST_ERR_NOT_FOUND => Code::NotFound,
                abi::DEVHOST_ERR_UNAVAILABLE => Code::Unavailable,
                abi::DEVHOST_ERR_TIMEOUT => Code::DeadlineExceeded,
                abi::DEVHOST_ERR_UNSUPPORTED => Code::Unimplemented,
                abi::DEVHOST_ERR_RESOURCE_EXHAUSTED => Code::ResourceExhausted,
                abi::DEVHOST_ERR_FAILED_PRECONDITION => Code::FailedPrecondition,
                _ => Code::Internal,
            },
            CallError::Timeout { .. } | CallError::Hung { .. } => Code::DeadlineExceeded,
            CallError::Poisoned { .. } => Code::Internal,
            CallError::ThreadGone { .. } | CallError::Unavailable { .. } => Code::Unavailable,
        };
        Status::new(code, e.to_string())
    }
}

impl From<CallError> for Status {
    fn from(e: CallError) -> Status {
        Status::from(&e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_status_keeps_its_class_and_a_lost_worker_is_unavailable() {
        let status = |code| CallError::Status {
            driver: "gpu".into(),
            call: "allocate",
            code,
            status: "NOT_FOUND",
            message: "no such device".into(),
        };
        let s = Status::from(status(abi::DEVHOST_ERR_NOT_FOUND));
        assert_eq!(s.code(), Code::NotFound);
        assert_eq!(s.message(), "driver gpu: allocate failed (NOT_FOUND): no such device");
        assert_eq!(Status::from(status(9999)).code(), Code::Internal);
        let lost = CallError::lost_in("gpu", "allocate", "its worker process exited");
        assert_eq!(Status::from(&lost).code(), Code::Unavailable);
    }
}
