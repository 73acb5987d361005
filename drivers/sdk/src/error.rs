//! Driver errors: a status code from the ABI plus a message for the operator.

use devhost_abi as abi;
use std::fmt;

/// The ABI status codes a driver may return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    InvalidArgument,
    NotFound,
    Unavailable,
    Timeout,
    Internal,
    Unsupported,
    ResourceExhausted,
    FailedPrecondition,
}

impl Status {
    pub fn code(self) -> abi::devhost_status {
        match self {
            Status::InvalidArgument => abi::DEVHOST_ERR_INVALID_ARGUMENT,
            Status::NotFound => abi::DEVHOST_ERR_NOT_FOUND,
            Status::Unavailable => abi::DEVHOST_ERR_UNAVAILABLE,
            Status::Timeout => abi::DEVHOST_ERR_TIMEOUT,
            Status::Internal => abi::DEVHOST_ERR_INTERNAL,
            Status::Unsupported => abi::DEVHOST_ERR_UNSUPPORTED,
            Status::ResourceExhausted => abi::DEVHOST_ERR_RESOURCE_EXHAUSTED,
            Status::FailedPrecondition => abi::DEVHOST_ERR_FAILED_PRECONDITION,
        }
    }
}

/// An error returned from a driver method: becomes the call's status and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error { status, message: message.into() }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Status::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Status::NotFound, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Status::Unavailable, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Status::Internal, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(Status::Unsupported, message)
    }
    pub fn resource_exhausted(message: impl Into<String>) -> Self {
        Self::new(Status::ResourceExhausted, message)
    }
    pub fn failed_precondition(message: impl Into<String>) -> Self {
        Self::new(Status::FailedPrecondition, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.status, self.message)
    }
}

impl std::error::Error for Error {}
